"""Graphs in the npz format of Shchur et al. 2018 ("Pitfalls of Graph Neural Network Evaluation"), and its split.

The format (shchur/gnn-benchmark, read by PyTorch Geometric's CitationFull, Amazon and Coauthor and by DGL) is
one `np.savez` archive: the adjacency in CSR parts (`adj_data`, `adj_indices`, `adj_indptr`, `adj_shape`), the
node attributes in CSR parts (`attr_data`, `attr_indices`, `attr_indptr`, `attr_shape`) or as a dense
`attr_matrix`, one integer class per node (`labels`) and, optionally, `class_names` (and `node_names`, unused).

The archive is read with `allow_pickle=False`: an object array inside is refused, never unpickled. The graph is
assembled as the Planetoid graphs are (gat.data): the adjacency symmetrised, self-loops and duplicates dropped,
each feature row divided by its sum. Such graphs carry no split: `pitfalls_split` draws the paper's.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from scipy import sparse
from torch import Tensor

from gat.data import Graph, Split, undirected_edge_index, csr_tensor_from_scipy, normalise_rows

# The Pitfalls protocol: per class, this many training and validation nodes, drawn at random; the rest test.
# A class with fewer than their sum is dropped (its nodes stay in the graph, unlabelled).
TRAIN_PER_CLASS = 20
VAL_PER_CLASS = 30

_ADJ = ("adj_data", "adj_indices", "adj_indptr", "adj_shape")
_ATTR = ("attr_data", "attr_indices", "attr_indptr", "attr_shape")


@dataclass(frozen=True)
class NpzGraph:
    """A parsed npz graph before any split: a Graph's tensors and the file's class names.

    Shapes (N nodes, F_in features, E directed edges): features [N, F_in] sparse CSR float32, row-normalised;
    edge_index [2, E] int64 as gat.data.Graph promises; labels [N] int64 in [0, len(class_names)).
    """

    features: Tensor
    edge_index: Tensor
    labels: Tensor
    class_names: tuple[str, ...]


def _arrays(data: bytes) -> Mapping[str, np.ndarray]:
    """Every array of the archive, loaded without unpickling; a pickled (object) array is refused by name."""
    try:
        archive = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"not an npz archive ({' '.join(str(error).split())[:120]})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):  # a bare .npy file loads as one array
        raise ValueError("not an npz archive (a single .npy array, not a zip of named arrays)")
    arrays = {}
    with archive:
        for name in archive.files:
            try:
                arrays[name] = archive[name]
            except ValueError as error:  # numpy: "Object arrays cannot be loaded when allow_pickle=False"
                if "allow_pickle" in str(error):
                    raise ValueError(f"{name}: a pickled (object) array; the format holds plain numeric and "
                                     "string arrays only, and pickles are never loaded") from None
                raise ValueError(f"{name}: not a readable array ({error})") from None
            except (OSError, EOFError, zipfile.BadZipFile) as error:
                raise ValueError(f"{name}: not a readable array ({error})") from None
    return arrays


def _require(arrays: Mapping[str, np.ndarray], names: tuple[str, ...]) -> None:
    missing = [name for name in names if name not in arrays]
    if missing:
        raise ValueError(f"{missing[0]}: missing field (the archive holds {', '.join(sorted(arrays)) or 'nothing'})")


def _shape(arrays: Mapping[str, np.ndarray], name: str) -> tuple[int, int]:
    value = arrays[name]
    if value.shape != (2,) or value.dtype.kind not in "iu" or (value < 0).any():
        raise ValueError(f"{name}: expected two non-negative integers (rows, columns), found {value.dtype} "
                         f"{value.tolist() if value.size <= 4 else value.shape}")
    return int(value[0]), int(value[1])


def _csr(arrays: Mapping[str, np.ndarray], prefix: str) -> sparse.csr_matrix:
    """The CSR matrix `<prefix>_data/_indices/_indptr/_shape`, each part checked before scipy sees it."""
    data, indices, indptr = (arrays[f"{prefix}_{part}"] for part in ("data", "indices", "indptr"))
    rows, columns = _shape(arrays, f"{prefix}_shape")
    for name, value, kinds in ((f"{prefix}_data", data, "biuf"), (f"{prefix}_indices", indices, "iu"),
                               (f"{prefix}_indptr", indptr, "iu")):
        if value.ndim != 1 or value.dtype.kind not in kinds:
            raise ValueError(f"{name}: expected a 1-D {'numeric' if kinds == 'biuf' else 'integer'} array, "
                             f"found a {value.ndim}-D {value.dtype} array")
    if len(indptr) != rows + 1:
        raise ValueError(f"{prefix}_indptr: {len(indptr)} entries, but {prefix}_shape has {rows} rows (needs rows + 1)")
    if indptr[0] != 0 or (np.diff(indptr) < 0).any() or indptr[-1] != len(indices):
        raise ValueError(f"{prefix}_indptr: must rise from 0 to len({prefix}_indices) = {len(indices)}")
    if len(data) != len(indices):
        raise ValueError(f"{prefix}_data: {len(data)} values, but {prefix}_indices has {len(indices)}")
    if len(indices) and (indices.min() < 0 or indices.max() >= columns):
        raise ValueError(f"{prefix}_indices: a column id is outside [0, {columns}) ({prefix}_shape)")
    bad = np.flatnonzero(~np.isfinite(data.astype(np.float64)))
    if bad.size:
        raise ValueError(f"{prefix}_data: {bad.size} NaN or infinite value(s)")
    return sparse.csr_matrix((data.astype(np.float32), indices.astype(np.int64), indptr.astype(np.int64)),
                             shape=(rows, columns))


def _attributes(arrays: Mapping[str, np.ndarray]) -> sparse.csr_matrix:
    """The attribute matrix: CSR parts, or a dense `attr_matrix` (gnn-benchmark's loader reads both)."""
    if "attr_data" in arrays or "attr_matrix" not in arrays:
        _require(arrays, _ATTR)
        return _csr(arrays, "attr")
    dense = arrays["attr_matrix"]
    if dense.ndim != 2 or dense.dtype.kind not in "biuf":
        raise ValueError(f"attr_matrix: expected a 2-D numeric array, found a {dense.ndim}-D {dense.dtype} array")
    if not np.isfinite(dense.astype(np.float64)).all():
        raise ValueError("attr_matrix: NaN or infinite value(s)")
    return sparse.csr_matrix(dense.astype(np.float32))


def _class_names(arrays: Mapping[str, np.ndarray], num_labels: int) -> tuple[str, ...]:
    """The file's class names (a unicode or bytes array), or the class ids as names when it has none."""
    if "class_names" not in arrays:
        return tuple(str(c) for c in range(num_labels))
    names = arrays["class_names"]
    if names.ndim != 1 or names.dtype.kind not in "US":
        raise ValueError(f"class_names: expected a 1-D array of strings, found a {names.ndim}-D {names.dtype} array")
    if len(names) < num_labels:
        raise ValueError(f"class_names: {len(names)} names, but labels go up to {num_labels - 1}")
    return tuple(name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name) for name in names.tolist())


def parse_npz(data: bytes) -> NpzGraph:
    """Parse one npz graph: the adjacency symmetrised without self-loops, features row-normalised.

    Raises ValueError, its message led by the field at fault (`labels: ...`), for anything malformed: not an npz,
    a pickled array, a missing field, parts whose shapes disagree, ids or labels out of range, NaN or inf, a graph
    without nodes or without edges between distinct nodes.
    """
    arrays = _arrays(data)
    if "labels_data" in arrays:
        raise ValueError("labels_data: multi-label classes (labels as a CSR matrix) are not supported; "
                         "a node classifier here needs one class per node in `labels`")
    _require(arrays, (*_ADJ, "labels"))
    adjacency = _csr(arrays, "adj")
    num_nodes = adjacency.shape[0]
    if adjacency.shape[1] != num_nodes:
        raise ValueError(f"adj_shape: {adjacency.shape[0]} x {adjacency.shape[1]}, but an adjacency is square")
    if num_nodes == 0:
        raise ValueError("adj_shape: the graph has no nodes")
    attributes = _attributes(arrays)
    attr = "attr_matrix" if "attr_data" not in arrays and "attr_matrix" in arrays else "attr_shape"
    if attributes.shape[0] != num_nodes:
        raise ValueError(f"{attr}: {attributes.shape[0]} rows, but adj_shape has {num_nodes} nodes")
    if attributes.shape[1] == 0:
        raise ValueError(f"{attr}: no feature columns")
    labels = arrays["labels"]
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ValueError(f"labels: expected a 1-D integer array (one class per node), found a {labels.ndim}-D "
                         f"{labels.dtype} array")
    if len(labels) != num_nodes:
        raise ValueError(f"labels: {len(labels)} entries, but adj_shape has {num_nodes} nodes")
    if (labels < 0).any():
        raise ValueError(f"labels: {int((labels < 0).sum())} negative class id(s), the first at node "
                         f"{int(np.flatnonzero(labels < 0)[0])}; every node needs a class in [0, classes)")
    class_names = _class_names(arrays, int(labels.max()) + 1)
    if labels.max() >= len(class_names):  # only with class_names present, which _class_names sized
        raise ValueError(f"labels: class {int(labels.max())} is out of range for the {len(class_names)} class_names")
    coo = adjacency.tocoo()
    edge_index = undirected_edge_index(coo.row.astype(np.int64), coo.col.astype(np.int64), num_nodes)
    if edge_index.shape[1] == 0:
        raise ValueError("adj_indices: no edges between distinct nodes (only self-loops, or none)")
    return NpzGraph(features=csr_tensor_from_scipy(normalise_rows(attributes)), edge_index=edge_index,
                    labels=torch.from_numpy(labels.astype(np.int64)), class_names=class_names)


@dataclass(frozen=True)
class PitfallsSplit:
    """The split, and what it did to the classes.

    Shapes: labels [N] int64, the kept classes renumbered 0.. in their original order, -1 for a dropped class's node.
    `kept`: the original ids of the kept classes, in their new order; `dropped`: original id -> its node count.
    """

    split: Split
    labels: Tensor
    kept: tuple[int, ...]
    dropped: dict[int, int]


def pitfalls_split(labels: Tensor, num_classes: int, *, seed: int, train_per_class: int = TRAIN_PER_CLASS,
                   val_per_class: int = VAL_PER_CLASS) -> PitfallsSplit:
    """Shchur et al.'s split: per class, `train_per_class` training and `val_per_class` validation nodes drawn at
    random with `seed`, the rest of the class test; a class with fewer nodes than both together is dropped.

    Deterministic on any machine: numpy's PCG64 generator, one permutation per kept class in class order.
    Raises ValueError when no class is large enough.

    Shapes: labels: [N] int64 in [0, num_classes) -> PitfallsSplit (labels [N])
    """
    needed = train_per_class + val_per_class
    counts = torch.bincount(labels, minlength=num_classes).tolist()
    kept = tuple(c for c in range(num_classes) if counts[c] >= needed)
    dropped = {c: counts[c] for c in range(num_classes) if counts[c] < needed}
    if not kept:
        raise ValueError(f"no class has the {needed} nodes ({train_per_class} training + {val_per_class} "
                         f"validation) the split needs; the largest has {max(counts, default=0)}")
    renumber = torch.full((num_classes,), -1, dtype=torch.int64)
    renumber[list(kept)] = torch.arange(len(kept))
    generator = np.random.default_rng(seed)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for c in kept:
        members = generator.permutation(torch.nonzero(labels == c).flatten().numpy())
        for part, chosen in zip(parts, np.split(members, [train_per_class, needed])):
            part.append(chosen)
    train, val, test = (torch.from_numpy(np.sort(np.concatenate(part))).to(torch.int64) for part in parts)
    return PitfallsSplit(Split(train, val, test), renumber[labels], kept, dropped)


def npz_graph(parsed: NpzGraph, *, seed: int) -> tuple[Graph, PitfallsSplit]:
    """The parsed graph with its seeded Pitfalls split, ready for training (labels renumbered to the kept classes)."""
    drawn = pitfalls_split(parsed.labels, len(parsed.class_names), seed=seed)
    graph = Graph(features=parsed.features, edge_index=parsed.edge_index, labels=drawn.labels,
                  train_idx=drawn.split.train_idx, val_idx=drawn.split.val_idx, test_idx=drawn.split.test_idx,
                  num_classes=len(drawn.kept))
    return graph, drawn


def kept_class_names(parsed: NpzGraph, drawn: PitfallsSplit) -> list[str]:
    """The names of the kept classes, in their new order: what meta.json and the figures call class 0, 1, ..."""
    return [parsed.class_names[c] for c in drawn.kept]


def dropped_summary(parsed: NpzGraph, drawn: PitfallsSplit) -> dict[str, Any]:
    """Class name -> node count of each dropped class, for meta.json and the stage's message."""
    return {parsed.class_names[c]: count for c, count in drawn.dropped.items()}
