"""The Planetoid citation datasets: from the eight raw files' bytes to a `Graph` of tensors.

The raw format (Yang et al. 2016, `kimiyoung/planetoid`) is eight files per dataset,
`ind.<dataset>.<part>`: Python 2 pickles of feature rows (`x`, `tx`, `allx`: scipy CSR),
one-hot labels (`y`, `ty`, `ally`: numpy), the adjacency lists (`graph`: a
`defaultdict(list)`), and `test.index`, the test node ids one per line. The assembly
follows Kipf's loader and PyTorch Geometric's `read_planetoid_data` row for row, so the
standard split is the one every published GAT/GCN number uses.

Pickles run code when loaded: callers verify checksums first (gat.datasets.verify_raw), and `_RestrictedUnpickler`
refuses every class the format does not use.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Any, Mapping

import numpy as np
import torch
from scipy import sparse
from torch import Tensor

from gat.datasets import PARTS, STANDARD_VAL_NODES, file_names

# At most this share of the test block may be ids missing from test.index (padded as
# unlabelled, featureless nodes, as Kipf's loader does). Citeseer's real files miss 15 of
# 1,015 ids (1.5 %), Cora's none; a tenth leaves room for that and still refuses a stray
# id far beyond the graph, which would otherwise add thousands of phantom nodes.
MAX_PADDED_TEST_FRACTION = 0.1

# numpy moved `_reconstruct` from numpy.core to numpy._core; take it from where ndarray pickles to.
_RECONSTRUCT = np.empty(0).__reduce__()[0]


def _latin1_bytes(text: Any, encoding: Any = "utf-8", *more: Any) -> bytes:
    """The one use of `_codecs.encode` in Planetoid pickles: a byte string, latin1-encoded.

    Python 3 writes bytes at pickle protocol 2 as `_codecs.encode(str, "latin1")`, so the
    genuine arrays re-pickled under Python 3 contain that call; any other use is refused.
    """
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or more:
        raise pickle.UnpicklingError(f"refusing _codecs.encode({type(text).__name__}, {encoding!r}): "
                                     "a Planetoid file only encodes byte strings as latin1")
    return text.encode("latin1")


# (module, name) as written in the pickles -> the object. The originals are Python 2
# pickles (`__builtin__`, `numpy.core`, `scipy.sparse.csr`); files pickled by current
# numpy/scipy name the private modules instead.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("scipy.sparse.csr", "csr_matrix"): sparse.csr_matrix,
    ("scipy.sparse._csr", "csr_matrix"): sparse.csr_matrix,
    ("collections", "defaultdict"): collections.defaultdict,
    ("__builtin__", "list"): list,
    ("builtins", "list"): list,
    ("_codecs", "encode"): _latin1_bytes,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the classes a Planetoid file contains; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: a Planetoid file holds only numpy arrays, "
                "scipy CSR matrices and a defaultdict(list), so this is not a genuine Planetoid file"
            ) from None


def restricted_unpickle(data: bytes, name: str, expected: type) -> Any:
    """Unpickle one file; every way it can fail is an UnpicklingError or ValueError naming `name`."""
    try:
        # latin1 decodes the Python 2 byte strings inside numpy arrays unchanged.
        value = _RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(f"{name}: {error}") from None
    except Exception as error:  # bad bytes fail in many ways: EOFError, KeyError, TypeError, MemoryError, ...
        raise pickle.UnpicklingError(f"{name}: not a readable pickle ({type(error).__name__}: {error})") from None
    if not isinstance(value, expected):
        raise ValueError(f"{name}: expected a pickled {expected.__name__}, found {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Split:
    """Node ids of each part of a split, sorted and disjoint.

    Shapes: train_idx: [N_train], val_idx: [N_val], test_idx: [N_test] (int64).
    """

    train_idx: Tensor
    val_idx: Tensor
    test_idx: Tensor


@dataclass(frozen=True, eq=False)
class Graph:
    """One Planetoid dataset, ready for a transductive node classifier.

    Shapes (N nodes, F_in features, E directed edges):
        features: [N, F_in] sparse CSR float32, each row divided by its sum (all-zero rows stay zero)
        edge_index: [2, E] int64, row 0 the source and row 1 the target; both directions of
            every undirected edge, no self-loops, no duplicates, sorted by target then source
        labels: [N] int64 class ids in [0, num_classes); -1 for a node without a label
            (Citeseer's 15 padded test nodes), so a loss over them fails loudly
        train_idx, val_idx, test_idx: [N_train], [N_val], [N_test] int64 node ids, sorted
    """

    features: Tensor
    edge_index: Tensor
    labels: Tensor
    train_idx: Tensor
    val_idx: Tensor
    test_idx: Tensor
    num_classes: int

    @property
    def num_nodes(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    @property
    def split(self) -> Split:
        return Split(self.train_idx, self.val_idx, self.test_idx)

    def with_split(self, split: Split) -> "Graph":
        return dataclasses.replace(self, train_idx=split.train_idx, val_idx=split.val_idx, test_idx=split.test_idx)


def _check_features(matrix: sparse.csr_matrix, name: str) -> None:
    """A well-formed CSR matrix of finite numbers: one NaN would turn every output of the model into NaN."""
    try:
        # Unpickling restores the arrays as they are; this checks indptr/indices against the shape.
        matrix.check_format(full_check=True)
    except (AttributeError, TypeError, ValueError) as error:
        raise ValueError(f"{name}: not a well-formed CSR matrix ({error})") from None
    if matrix.dtype.kind not in "biuf":
        raise ValueError(f"{name}: feature values must be numbers, found dtype {matrix.dtype}")
    bad = np.flatnonzero(~np.isfinite(matrix.data))
    if bad.size:
        row = int(np.searchsorted(matrix.indptr, bad[0], side="right")) - 1
        raise ValueError(f"{name}: {bad.size} NaN or infinite feature value(s), the first in row {row}")


def _check_one_hot(labels: np.ndarray, name: str) -> None:
    """A 2-D array of 0/1 rows, each with at most one 1 (an all-zero row is a node without a label)."""
    if labels.ndim != 2 or labels.dtype.kind not in "biuf":
        raise ValueError(f"{name}: expected a 2-D array of one-hot labels, "
                         f"found a {labels.ndim}-D {labels.dtype} array")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError(f"{name}: holds values other than 0 and 1 (or NaN); each label row is one-hot")
    multiple = np.flatnonzero(labels.sum(axis=1) > 1)
    if multiple.size:
        raise ValueError(f"{name}: row {multiple[0]} has more than one 1; a one-hot label has exactly one")


def _check_same_columns(columns: Mapping[str, int], what: str) -> None:
    """`columns`: file name -> its number of columns; the first file sets the expected number."""
    (reference, expected), *others = columns.items()
    for name, count in others:
        if count != expected:
            raise ValueError(f"{name}: {count} {what} columns, but {reference} has {expected}")


def _require_labels(labels: np.ndarray, name: str, num_rows: int, part: str) -> None:
    """The first `num_rows` rows are nodes of the standard split's `part`: each needs its class.

    Shapes: labels: [N_rows, C] one-hot
    """
    unlabelled = np.flatnonzero(~labels[:num_rows].any(axis=1))
    if unlabelled.size:
        raise ValueError(f"{name}: row {unlabelled[0]} is all zero ({unlabelled.size} of the first {num_rows} rows "
                         f"are), but every {part} node of the standard split needs exactly one class")


def _parse_test_index(data: bytes, name: str, first_id: int) -> np.ndarray:
    """The test node ids, one per line: distinct, the lowest `first_id`, and few missing in their range.

    `first_id` is the number of allx rows: the test block follows them. Shapes: -> [N_test] int64
    """
    tokens = data.split()
    if not tokens:
        raise ValueError(f"{name}: holds no test node ids")
    # 18 digits stay far below int64's limit, and far above any real node id.
    not_ids = [token for token in tokens if not (token.isdigit() and len(token) <= 18)]
    if not_ids:
        raise ValueError(f"{name}: {not_ids[0][:30].decode('ascii', 'replace')!r} is not a node id; "
                         "the file holds one non-negative integer per line")
    ids = np.array([int(token) for token in tokens], dtype=np.int64)
    distinct, counts = np.unique(ids, return_counts=True)
    if distinct.size != ids.size:
        repeated = np.flatnonzero(counts > 1)[0]
        raise ValueError(f"{name}: node {distinct[repeated]} is listed {counts[repeated]} times; "
                         "each test node appears once")
    low, high = int(distinct[0]), int(distinct[-1])
    if low != first_id:
        raise ValueError(f"{name}: the test ids start at node {low}, but allx/ally hold {first_id} rows; "
                         "the test nodes must follow them")
    padding = (high - low + 1) - ids.size
    if padding > MAX_PADDED_TEST_FRACTION * ids.size:
        raise ValueError(f"{name}: the test ids run up to node {high}, so {padding} of the {high - low + 1} ids from "
                         f"{low} on would be padded, unlabelled nodes; at most {MAX_PADDED_TEST_FRACTION:.0%} of "
                         f"the {ids.size} test rows may be missing (Citeseer misses 15)")
    return ids


def _place_test_rows(all_rows: Any, test_rows: Any, test_index: np.ndarray) -> Any:
    """Stack `all_rows` and `test_rows` so that test row k lands on node `test_index[k]`.

    Exactly Kipf's loader: pad the test block with zero rows for ids missing from
    `test.index` (Citeseer), stack, then move the rows into test.index order. The
    padding is a 0/1 placement matrix product, which works for sparse and dense rows alike.
    `test_index` is as `_parse_test_index` returns it: distinct ids from N_all on.

    Shapes: all_rows: [N_all, D], test_rows: [N_test, D], test_index: [N_test] -> [N, D]
    """
    ordered = np.sort(test_index)
    low, high = int(ordered[0]), int(ordered[-1])
    span = high - low + 1
    num_test = len(test_index)
    placement = sparse.csr_matrix((np.ones(num_test), (ordered - low, np.arange(num_test))), shape=(span, num_test))
    padded = placement @ test_rows
    stacked = sparse.vstack([all_rows, padded]).tocsr() if sparse.issparse(all_rows) else np.vstack([all_rows, padded])
    order = np.arange(stacked.shape[0])
    order[test_index] = ordered
    return stacked[order]


def normalise_rows(features: sparse.csr_matrix) -> sparse.csr_matrix:
    """Each row divided by its sum (an all-zero row stays zero), with sorted, distinct column ids per row."""
    sums = np.asarray(features.sum(axis=1)).ravel()
    inverse = np.divide(1.0, sums, out=np.zeros_like(sums), where=sums != 0)
    normalised = (sparse.diags(inverse) @ features).tocsr()
    # Torch's CSR wants sorted, distinct column ids per row; the pickled rows need not be.
    normalised.sum_duplicates()
    return normalised


def _adjacency_arrays(adjacency_lists: Mapping[Any, Any], name: str, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(sources, targets) of every listed edge, each id checked to be a node. Shapes: -> [E_raw], [E_raw]"""
    # numpy turns the string "12" into the node 12 without a word: only integers are node ids.
    for node, neighbours in adjacency_lists.items():
        if not _is_node_id(node):
            raise ValueError(f"{name}: the key {node!r} is a {type(node).__name__}, not a node id; "
                             "the graph maps integer node ids to lists of integer node ids")
        listed = neighbours if isinstance(neighbours, (list, tuple)) else ()
        stray = next((other for other in listed if not _is_node_id(other)), None)
        if stray is not None:
            raise ValueError(f"{name}: node {node}'s neighbour {stray!r} is a {type(stray).__name__}, not a node id; "
                             "the graph maps integer node ids to lists of integer node ids")
    try:
        degrees = [len(neighbours) for neighbours in adjacency_lists.values()]
        sources = np.repeat(np.fromiter(adjacency_lists.keys(), dtype=np.int64, count=len(adjacency_lists)), degrees)
        targets = np.fromiter(chain.from_iterable(adjacency_lists.values()), dtype=np.int64, count=sum(degrees))
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"{name}: expected a mapping of node ids to lists of node ids ({error})") from None
    if len(targets) and (min(sources.min(), targets.min()) < 0 or max(sources.max(), targets.max()) >= num_nodes):
        raise ValueError(f"{name}: a node id is outside [0, {num_nodes})")
    return sources, targets


def _is_node_id(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def undirected_edge_index(sources: np.ndarray, targets: np.ndarray, num_nodes: int) -> Tensor:
    """Symmetrise, drop self-loops and duplicates (both occur in the raw lists), sort by target."""
    keep = sources != targets
    # Row = target, column = source: CSR order is then target-major, source-minor.
    adjacency = sparse.coo_matrix((np.ones(keep.sum()), (targets[keep], sources[keep])), shape=(num_nodes, num_nodes))
    adjacency = (adjacency + adjacency.T).tocsr()
    adjacency.sum_duplicates()
    target = np.repeat(np.arange(num_nodes), np.diff(adjacency.indptr))
    return torch.from_numpy(np.stack([adjacency.indices.astype(np.int64), target]))


def _csr_tensor(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    # CSR is a deliberate choice here; torch's one-time "beta" warning would only alarm every stage's output.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=True)


def csr_tensor_from_scipy(matrix: sparse.csr_matrix) -> Tensor:
    """A scipy CSR matrix as torch's sparse CSR tensor: int64 indices, float32 values."""
    return _csr_tensor(torch.from_numpy(matrix.indptr.astype(np.int64)),
                       torch.from_numpy(matrix.indices.astype(np.int64)),
                       torch.from_numpy(matrix.data.astype(np.float32)), matrix.shape)


def parse_planetoid(raw: Mapping[str, bytes], dataset: str) -> Graph:
    """Assemble a dataset from its eight files, with the standard Planetoid split.

    Args:
        raw: file name (`ind.<dataset>.<part>`, see `file_names`) -> the file's bytes.
        dataset: the name inside the file names, e.g. `cora`.

    The split: train = the first len(y) nodes, val = the next 500, test = the
    test.index nodes. Nodes padded in for missing test ids are in no split.

    Raises ValueError or pickle.UnpicklingError, its message led by the file's name, for
    bytes that are not well-formed Planetoid data.
    """
    names = dict(zip(PARTS, file_names(dataset)))
    missing = [name for name in names.values() if name not in raw]
    if missing:
        raise ValueError(f"missing raw files: {', '.join(missing)}")
    x, tx, allx = (restricted_unpickle(raw[names[part]], names[part], sparse.csr_matrix)
                   for part in ("x", "tx", "allx"))
    y, ty, ally = (restricted_unpickle(raw[names[part]], names[part], np.ndarray) for part in ("y", "ty", "ally"))
    adjacency_lists = restricted_unpickle(raw[names["graph"]], names["graph"], dict)
    for part, matrix in (("x", x), ("tx", tx), ("allx", allx)):
        _check_features(matrix, names[part])
    for part, labels in (("y", y), ("ty", ty), ("ally", ally)):
        _check_one_hot(labels, names[part])
    _check_same_columns({names[part]: matrix.shape[1] for part, matrix in (("allx", allx), ("x", x), ("tx", tx))},
                        "feature")
    _check_same_columns({names[part]: labels.shape[1] for part, labels in (("ally", ally), ("y", y), ("ty", ty))},
                        "class")
    test_index = _parse_test_index(raw[names["test.index"]], names["test.index"], first_id=allx.shape[0])
    if not (x.shape[0] == y.shape[0] and tx.shape[0] == ty.shape[0] == len(test_index)
            and allx.shape[0] == ally.shape[0]):
        raise ValueError(f"ind.{dataset}.*: row counts disagree: x {x.shape[0]}, y {y.shape[0]}, tx {tx.shape[0]}, "
                         f"ty {ty.shape[0]}, test.index {len(test_index)}, allx {allx.shape[0]}, ally {ally.shape[0]}")
    num_train = y.shape[0]
    if num_train + STANDARD_VAL_NODES > allx.shape[0]:
        raise ValueError(f"{names['allx']}: {num_train} training + {STANDARD_VAL_NODES} validation nodes exceed "
                         f"its {allx.shape[0]} rows")
    # Without these, an unlabelled node in a split fails much later, in describe's bincount or the loss.
    # The real files have no all-zero rows: Citeseer's 15 unlabelled nodes are ids missing from
    # test.index, padded in below, and in no split.
    _require_labels(y, names["y"], num_train, "training")
    _require_labels(ally, names["ally"], num_train + STANDARD_VAL_NODES, "training or validation")
    _require_labels(ty, names["ty"], len(ty), "test")

    features = normalise_rows(_place_test_rows(allx.astype(np.float32), tx.astype(np.float32), test_index))
    one_hot = _place_test_rows(ally, ty, test_index)
    labels = np.where(one_hot.any(axis=1), one_hot.argmax(axis=1), -1)
    num_nodes = len(labels)
    edge_index = undirected_edge_index(*_adjacency_arrays(adjacency_lists, names["graph"], num_nodes), num_nodes)
    if edge_index.shape[1] == 0:
        # Attention over self-loops alone is a per-node MLP: nothing a graph model would be measured on.
        raise ValueError(f"{names['graph']}: holds no edges between distinct nodes (only self-loops, or none); "
                         "a citation graph links its papers")
    return Graph(
        features=csr_tensor_from_scipy(features),
        edge_index=edge_index,
        labels=torch.from_numpy(labels.astype(np.int64)),
        train_idx=torch.arange(num_train),
        val_idx=torch.arange(num_train, num_train + STANDARD_VAL_NODES),
        test_idx=torch.from_numpy(np.sort(test_index)),
        num_classes=int(ally.shape[1]),
    )


def random_split(labels: Tensor, *, seed: int, train_size: int, val_size: int, test_size: int) -> Split:
    """A seeded random split of the labelled nodes (the annotated labml tutorial's protocol).

    One permutation of the labelled nodes (label >= 0): the first `train_size` train, the
    next `val_size` validate, the next `test_size` test. The same seed gives the same split.

    Shapes: labels: [N] -> Split of [train_size], [val_size], [test_size]
    """
    eligible = torch.nonzero(labels >= 0).flatten()
    needed = train_size + val_size + test_size
    if needed > eligible.numel():
        raise ValueError(f"a random split of {train_size} + {val_size} + {test_size} = {needed} nodes "
                         f"needs more than the {eligible.numel()} labelled nodes there are")
    generator = torch.Generator().manual_seed(seed)
    order = eligible[torch.randperm(eligible.numel(), generator=generator)]
    bounds = (0, train_size, train_size + val_size, needed)
    return Split(*(order[start:stop].sort().values for start, stop in zip(bounds, bounds[1:])))


def describe(graph: Graph) -> dict[str, Any]:
    """Sizes and per-class counts of each split, for meta.json and logging."""
    def counts(idx: Tensor) -> dict[str, Any]:
        per_class = torch.bincount(graph.labels[idx], minlength=graph.num_classes)
        return {"count": int(idx.numel()), "per_class": per_class.tolist()}

    return {
        "num_nodes": graph.num_nodes,
        "num_features": graph.num_features,
        "num_classes": graph.num_classes,
        "num_edges": int(graph.edge_index.shape[1]) // 2,
        "splits": {name: counts(idx) for name, idx in
                   (("train", graph.train_idx), ("val", graph.val_idx), ("test", graph.test_idx))},
    }


_TENSOR_KEYS = ("features_crow_indices", "features_col_indices", "features_values", "features_shape",
                "edge_index", "labels", "train_idx", "val_idx", "test_idx", "num_classes")


def graph_to_tensors(graph: Graph) -> dict[str, Tensor]:
    """Plain dense tensors only, so `torch.load(..., weights_only=True)` can read them back."""
    return {
        "features_crow_indices": graph.features.crow_indices(),
        "features_col_indices": graph.features.col_indices(),
        "features_values": graph.features.values(),
        "features_shape": torch.tensor(graph.features.shape, dtype=torch.int64),
        "edge_index": graph.edge_index,
        "labels": graph.labels,
        "train_idx": graph.train_idx,
        "val_idx": graph.val_idx,
        "test_idx": graph.test_idx,
        "num_classes": torch.tensor(graph.num_classes, dtype=torch.int64),
    }


def graph_from_tensors(tensors: Mapping[str, Tensor]) -> Graph:
    """The inverse of `graph_to_tensors`; raises ValueError when a key is missing or the graph breaks a
    promise of Graph's docstring (check_graph)."""
    missing = [key for key in _TENSOR_KEYS if key not in tensors]
    if missing:
        raise ValueError(f"not a saved graph: missing {', '.join(missing)}")
    features = _csr_tensor(tensors["features_crow_indices"], tensors["features_col_indices"],
                           tensors["features_values"], tuple(tensors["features_shape"].tolist()))
    graph = Graph(
        features=features,
        edge_index=tensors["edge_index"],
        labels=tensors["labels"],
        train_idx=tensors["train_idx"],
        val_idx=tensors["val_idx"],
        test_idx=tensors["test_idx"],
        num_classes=int(tensors["num_classes"]),
    )
    check_graph(graph)
    return graph


def _check_ids(ids: Tensor, name: str, low: int, high: int, *, dims: int = 1) -> None:
    """`ids`: an int64 tensor of `dims` dimensions whose values lie in [low, high)."""
    if ids.dtype != torch.int64 or ids.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D int64 tensor, found {ids.dim()}-D {ids.dtype}")
    outside = ids[(ids < low) | (ids >= high)]
    if outside.numel():
        raise ValueError(f"{name}: {outside.numel()} value(s) outside [{low}, {high}), the first {int(outside[0])}")


def check_graph(graph: Graph) -> None:
    """Raise ValueError unless `graph` keeps the promises of Graph's docstring that training relies on: node ids
    and labels in range (the fused kernel indexes memory with them, unchecked), splits that are not empty and
    whose training and validation nodes are labelled, finite features."""
    nodes = graph.num_nodes
    if graph.num_classes < 1:
        raise ValueError(f"num_classes is {graph.num_classes}")
    if graph.features.shape[0] != nodes:
        raise ValueError(f"features: {graph.features.shape[0]} rows for {nodes} nodes")
    if not bool(torch.isfinite(graph.features.values()).all()):
        raise ValueError("features: NaN or infinite values")
    _check_ids(graph.labels, "labels", -1, graph.num_classes)
    _check_ids(graph.edge_index, "edge_index", 0, nodes, dims=2)
    if graph.edge_index.shape[0] != 2:
        raise ValueError(f"edge_index: expected 2 rows (sources, targets), found {graph.edge_index.shape[0]}")
    for name, ids in (("train_idx", graph.train_idx), ("val_idx", graph.val_idx), ("test_idx", graph.test_idx)):
        _check_ids(ids, name, 0, nodes)
        if ids.numel() == 0:
            raise ValueError(f"{name}: no nodes")
    for name, ids in (("train_idx", graph.train_idx), ("val_idx", graph.val_idx)):
        if bool((graph.labels[ids] < 0).any()):
            raise ValueError(f"{name}: holds nodes without a label")
