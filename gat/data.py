"""The Planetoid citation datasets: from the eight raw files' bytes to a `Graph` of tensors.

The raw format (Yang et al. 2016, `kimiyoung/planetoid`) is eight files per dataset,
`ind.<dataset>.<part>`: Python 2 pickles of feature rows (`x`, `tx`, `allx`: scipy CSR),
one-hot labels (`y`, `ty`, `ally`: numpy), the adjacency lists (`graph`: a
`defaultdict(list)`), and `test.index`, the test node ids one per line. The assembly
follows Kipf's loader and PyTorch Geometric's `read_planetoid_data` row for row, so the
standard split is the one every published GAT/GCN number uses.

Pickles run code when loaded: callers verify checksums first, and `_RestrictedUnpickler`
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

PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")

# The standard Planetoid validation set: the 500 nodes right after the training nodes.
NUM_VAL = 500

# numpy moved `_reconstruct` from numpy.core to numpy._core; take it from where ndarray pickles to.
_RECONSTRUCT = np.empty(0).__reduce__()[0]

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
}


def file_names(dataset: str) -> list[str]:
    """The eight raw file names of `dataset`, in `PARTS` order: `ind.cora.x`, ..."""
    return [f"ind.{dataset}.{part}" for part in PARTS]


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


def _unpickle(data: bytes, name: str, expected: type) -> Any:
    # latin1 decodes the Python 2 byte strings inside numpy arrays unchanged.
    value = _RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
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


def _place_test_rows(all_rows: Any, test_rows: Any, test_index: np.ndarray) -> Any:
    """Stack `all_rows` and `test_rows` so that test row k lands on node `test_index[k]`.

    Exactly Kipf's loader: pad the test block with zero rows for ids missing from
    `test.index` (Citeseer), stack, then move the rows into test.index order. The
    padding is a 0/1 placement matrix product, which works for sparse and dense rows alike.

    Shapes: all_rows: [N_all, D], test_rows: [N_test, D], test_index: [N_test] -> [N, D]
    """
    ordered = np.sort(test_index)
    low, high = int(ordered[0]), int(ordered[-1])
    if low != all_rows.shape[0]:
        raise ValueError(f"test.index starts at node {low}, but allx/ally hold {all_rows.shape[0]} rows; "
                         "the test nodes must follow them")
    span = high - low + 1
    num_test = len(test_index)
    placement = sparse.csr_matrix((np.ones(num_test), (ordered - low, np.arange(num_test))), shape=(span, num_test))
    padded = placement @ test_rows
    stacked = sparse.vstack([all_rows, padded]).tocsr() if sparse.issparse(all_rows) else np.vstack([all_rows, padded])
    order = np.arange(stacked.shape[0])
    order[test_index] = ordered
    return stacked[order]


def _normalise_rows(features: sparse.csr_matrix) -> sparse.csr_matrix:
    sums = np.asarray(features.sum(axis=1)).ravel()
    inverse = np.divide(1.0, sums, out=np.zeros_like(sums), where=sums != 0)
    normalised = (sparse.diags(inverse) @ features).tocsr()
    # Torch's CSR wants sorted, distinct column ids per row; the pickled rows need not be.
    normalised.sum_duplicates()
    return normalised


def _edge_index(adjacency_lists: Mapping[int, list[int]], num_nodes: int) -> Tensor:
    """Symmetrise, drop self-loops and duplicates (both occur in the raw lists), sort by target."""
    sources = np.repeat(np.fromiter(adjacency_lists.keys(), dtype=np.int64),
                        [len(neighbours) for neighbours in adjacency_lists.values()])
    targets = np.fromiter(chain.from_iterable(adjacency_lists.values()), dtype=np.int64)
    if len(targets) and (min(sources.min(), targets.min()) < 0 or max(sources.max(), targets.max()) >= num_nodes):
        raise ValueError(f"graph: a node id is outside [0, {num_nodes})")
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


def _from_scipy(matrix: sparse.csr_matrix) -> Tensor:
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
    """
    names = dict(zip(PARTS, file_names(dataset)))
    missing = [name for name in names.values() if name not in raw]
    if missing:
        raise ValueError(f"missing raw files: {', '.join(missing)}")
    x = _unpickle(raw[names["x"]], names["x"], sparse.csr_matrix)
    y = _unpickle(raw[names["y"]], names["y"], np.ndarray)
    tx = _unpickle(raw[names["tx"]], names["tx"], sparse.csr_matrix)
    ty = _unpickle(raw[names["ty"]], names["ty"], np.ndarray)
    allx = _unpickle(raw[names["allx"]], names["allx"], sparse.csr_matrix)
    ally = _unpickle(raw[names["ally"]], names["ally"], np.ndarray)
    adjacency_lists = _unpickle(raw[names["graph"]], names["graph"], dict)
    test_index = np.array(raw[names["test.index"]].decode("ascii").split(), dtype=np.int64)
    if not (x.shape[0] == y.shape[0] and tx.shape[0] == ty.shape[0] == len(test_index)
            and allx.shape[0] == ally.shape[0]):
        raise ValueError(f"{dataset}: row counts disagree: x {x.shape[0]}, y {y.shape[0]}, tx {tx.shape[0]}, "
                         f"ty {ty.shape[0]}, test.index {len(test_index)}, allx {allx.shape[0]}, ally {ally.shape[0]}")

    features = _normalise_rows(_place_test_rows(allx.astype(np.float32), tx.astype(np.float32), test_index))
    one_hot = _place_test_rows(ally, ty, test_index)
    labels = np.where(one_hot.any(axis=1), one_hot.argmax(axis=1), -1)
    num_nodes = len(labels)
    num_train = y.shape[0]
    if num_train + NUM_VAL > allx.shape[0]:
        raise ValueError(f"{dataset}: {num_train} training + {NUM_VAL} validation nodes exceed "
                         f"the {allx.shape[0]} rows of allx")

    return Graph(
        features=_from_scipy(features),
        edge_index=_edge_index(adjacency_lists, num_nodes),
        labels=torch.from_numpy(labels.astype(np.int64)),
        train_idx=torch.arange(num_train),
        val_idx=torch.arange(num_train, num_train + NUM_VAL),
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
    """The inverse of `graph_to_tensors`; raises ValueError when a key is missing."""
    missing = [key for key in _TENSOR_KEYS if key not in tensors]
    if missing:
        raise ValueError(f"not a saved graph: missing {', '.join(missing)}")
    features = _csr_tensor(tensors["features_crow_indices"], tensors["features_col_indices"],
                           tensors["features_values"], tuple(tensors["features_shape"].tolist()))
    return Graph(
        features=features,
        edge_index=tensors["edge_index"],
        labels=tensors["labels"],
        train_idx=tensors["train_idx"],
        val_idx=tensors["val_idx"],
        test_idx=tensors["test_idx"],
        num_classes=int(tensors["num_classes"]),
    )
