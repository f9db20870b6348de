"""gat.npz: the gnn-benchmark npz format parsed, each malformed input refused by its field, the Pitfalls split."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import sparse

from gat.npz import npz_graph, parse_npz, pitfalls_split

SHARED_NPZ = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "npz"


def npz_arrays(num_nodes: int = 6, labels: list[int] | None = None) -> dict[str, Any]:
    """A tiny graph's arrays as gnn-benchmark writes them: a path 0-1-2-3-4-5 listed one way, a self-loop on 0,
    the edge 1-2 listed both ways, integer attribute counts, class names as a unicode array."""
    rows = [0, 0, 1, 2, 2, 3, 4]
    cols = [0, 1, 2, 1, 3, 4, 5]
    adjacency = sparse.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(num_nodes, num_nodes))
    attributes = sparse.csr_matrix(np.array([[1, 1, 0], [0, 2, 0], [0, 0, 0], [3, 0, 1], [1, 0, 0], [0, 1, 1]],
                                            np.float32)[:num_nodes])
    return {"adj_data": adjacency.data, "adj_indices": adjacency.indices, "adj_indptr": adjacency.indptr,
            "adj_shape": np.array(adjacency.shape), "attr_data": attributes.data, "attr_indices": attributes.indices,
            "attr_indptr": attributes.indptr, "attr_shape": np.array(attributes.shape),
            "labels": np.array(labels if labels is not None else [0, 1, 0, 1, 0, 1][:num_nodes], np.int8),
            "class_names": np.array(["Alpha", "Beta"])}


def npz_bytes(arrays: dict[str, Any], **save: Any) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, **save)
    return buffer.getvalue()


def test_parses_symmetrised_without_self_loops_and_row_normalised() -> None:
    parsed = parse_npz(npz_bytes(npz_arrays()))
    edges = set(map(tuple, parsed.edge_index.T.tolist()))
    path = {(i, i + 1) for i in range(5)}
    assert edges == path | {(j, i) for i, j in path}  # both directions, the loop on 0 and the duplicate 1-2 gone
    assert parsed.edge_index.shape[1] == len(edges)
    # Sorted by target then source, as gat.data.Graph promises.
    targets, sources = parsed.edge_index[1].tolist(), parsed.edge_index[0].tolist()
    assert list(zip(targets, sources)) == sorted(zip(targets, sources))
    dense = parsed.features.to_dense()
    assert torch.allclose(dense[0], torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(dense[3], torch.tensor([0.75, 0.0, 0.25]))
    assert dense[2].abs().sum() == 0  # an all-zero row stays zero
    assert parsed.labels.tolist() == [0, 1, 0, 1, 0, 1] and parsed.class_names == ("Alpha", "Beta")


def test_dense_attr_matrix_and_missing_class_names_are_accepted() -> None:
    arrays = npz_arrays()
    dense = sparse.csr_matrix((arrays.pop("attr_data"), arrays.pop("attr_indices"), arrays.pop("attr_indptr")),
                              shape=tuple(arrays.pop("attr_shape"))).toarray()
    del arrays["class_names"]
    parsed = parse_npz(npz_bytes(arrays, attr_matrix=dense))
    assert parsed.features.shape == (6, 3) and parsed.class_names == ("0", "1")


def _with(**changes: Any) -> bytes:
    arrays = npz_arrays()
    for key, value in changes.items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    return npz_bytes(arrays)


@pytest.mark.parametrize("data, field", [
    (b"not a zip at all", "not an npz archive"),
    (_with(labels=None), "labels: missing field"),
    (_with(adj_indptr=None), "adj_indptr: missing field"),
    (_with(attr_data=None, attr_indices=None, attr_indptr=None, attr_shape=None), "attr_data: missing field"),
    (_with(adj_shape=np.array([6, 5])), "adj_indices|adj_shape"),
    (_with(adj_shape=np.array([7, 7])), "adj_indptr: 7 entries, but adj_shape has 7 rows"),
    (_with(adj_indices=np.array([0, 1, 2, 1, 3, 4, 9], np.int32)), "adj_indices: a column id is outside"),
    (_with(adj_data=np.ones(5, np.float32)), "adj_data: 5 values"),
    (_with(attr_shape=np.array([5, 3])), "attr_indptr"),
    (_with(attr_data=np.array([1, 1, 2, 3, np.nan, 1, 1, 1], np.float32)), "attr_data: 1 NaN or infinite"),
    (_with(attr_data=np.array([1, 1, 2, 3, np.inf, 1, 1, 1], np.float32)), "attr_data: 1 NaN or infinite"),
    (_with(labels=np.array([0, 1, 0, 1, 0], np.int8)), "labels: 5 entries, but adj_shape has 6 nodes"),
    (_with(labels=np.array([0, 1, 0, -1, 0, 1], np.int8)), "labels: 1 negative class id"),
    (_with(labels=np.array([0, 1, 0, 2, 0, 1], np.int8)), "class_names: 2 names, but labels go up to 2"),
    (_with(labels=np.array([0.0, 1, 0, 1, 0, 1])), "labels: expected a 1-D integer array"),
    (_with(class_names=np.array([1, 2])), "class_names: expected a 1-D array of strings"),
    (_with(adj_data=np.ones(1, np.float32), adj_indices=np.array([0], np.int32),
           adj_indptr=np.array([0, 1, 1, 1, 1, 1, 1], np.int32)), "adj_indices: no edges between distinct nodes"),
    (_with(labels_data=np.ones(2)), "labels_data: multi-label"),
])
def test_malformed_input_is_refused_naming_the_field(data: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=field) as refused:
        parse_npz(data)
    assert "\n" not in str(refused.value)


def test_empty_graph_is_refused() -> None:
    empty = {"adj_data": np.zeros(0, np.float32), "adj_indices": np.zeros(0, np.int32),
             "adj_indptr": np.zeros(1, np.int32), "adj_shape": np.array([0, 0]), "attr_data": np.zeros(0, np.float32),
             "attr_indices": np.zeros(0, np.int32), "attr_indptr": np.zeros(1, np.int32),
             "attr_shape": np.array([0, 3]), "labels": np.zeros(0, np.int8)}
    with pytest.raises(ValueError, match="adj_shape: the graph has no nodes"):
        parse_npz(npz_bytes(empty))


class _Boom:
    def __reduce__(self) -> tuple:
        return (print, ("pickle ran",))


def test_a_pickle_inside_is_refused_not_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    # np.savez pickles an object array; np.load(allow_pickle=False) must refuse it by name, never run it.
    arrays = npz_arrays()
    arrays["class_names"] = np.array([_Boom(), "Beta"], dtype=object)
    with pytest.raises(ValueError, match="class_names: a pickled"):
        parse_npz(npz_bytes(arrays))
    assert "pickle ran" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="not an npz archive"):  # a bare pickle is no zip
        parse_npz(pickle.dumps(np.zeros(3)))


def _labels(counts: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((count,), c) for c, count in enumerate(counts)])[torch.randperm(sum(counts),
                      generator=torch.Generator().manual_seed(0))]


def test_split_counts_per_class_and_dropped_classes() -> None:
    labels = _labels([60, 49, 80, 0, 50])
    drawn = pitfalls_split(labels, 5, seed=0)
    assert drawn.kept == (0, 2, 4) and drawn.dropped == {1: 49, 3: 0}
    # Kept classes renumbered in order; the dropped class's nodes stay in the graph, unlabelled.
    assert drawn.labels[labels == 1].eq(-1).all() and drawn.labels[labels == 2].eq(1).all()
    split = drawn.split
    assert torch.bincount(drawn.labels[split.train_idx], minlength=3).tolist() == [20, 20, 20]
    assert torch.bincount(drawn.labels[split.val_idx], minlength=3).tolist() == [30, 30, 30]
    assert torch.bincount(drawn.labels[split.test_idx], minlength=3).tolist() == [10, 30, 0]
    every = torch.cat([split.train_idx, split.val_idx, split.test_idx])
    assert every.unique().numel() == every.numel() == 190  # disjoint, and only kept classes' nodes
    for ids in (split.train_idx, split.val_idx, split.test_idx):
        assert ids.dtype == torch.int64 and torch.equal(ids, ids.sort().values)


def test_split_is_seeded() -> None:
    labels = _labels([70, 90, 55])
    first, again, other = (pitfalls_split(labels, 3, seed=seed).split for seed in (3, 3, 4))
    assert all(torch.equal(a, b) for a, b in zip(vars(first).values(), vars(again).values()))
    assert not torch.equal(first.train_idx, other.train_idx)
    # Pinned: numpy's PCG64 gives these ids on any machine; a change of generator or order would show here.
    assert first.train_idx[:8].tolist() == [1, 8, 9, 10, 12, 34, 36, 38]


def test_split_needs_one_class_of_fifty() -> None:
    with pytest.raises(ValueError, match="no class has the 50 nodes"):
        pitfalls_split(_labels([49, 10]), 2, seed=0)


def test_npz_graph_keeps_the_graph_promises() -> None:
    from gat.data import check_graph

    # 120 nodes on a ring: class 0 has 60, class 1 has 60, class 2 (named) has none and is dropped.
    n = 120
    ring = sparse.csr_matrix((np.ones(n, np.float32), (np.arange(n), (np.arange(n) + 1) % n)), shape=(n, n))
    attributes = sparse.csr_matrix(np.eye(n, 4, dtype=np.float32) + 1)
    arrays = {"adj_data": ring.data, "adj_indices": ring.indices, "adj_indptr": ring.indptr,
              "adj_shape": np.array(ring.shape), "attr_data": attributes.data, "attr_indices": attributes.indices,
              "attr_indptr": attributes.indptr, "attr_shape": np.array(attributes.shape),
              "labels": np.arange(n) % 2, "class_names": np.array(["a", "b", "c"])}
    graph, drawn = npz_graph(parse_npz(npz_bytes(arrays)), seed=1)
    check_graph(graph)
    assert graph.num_classes == 2 and drawn.dropped == {2: 0} and graph.edge_index.shape[1] == 2 * n


@pytest.mark.skipif(not SHARED_NPZ.is_dir(), reason="needs the real npz files in ../shared/datasets/npz")
@pytest.mark.parametrize("name, nodes, features, classes, edges", [("cora", 2708, 1433, 7, 5278),
                                                                   ("citeseer", 3312, 3703, 6, 4536)])
def test_real_files(name: str, nodes: int, features: int, classes: int, edges: int) -> None:
    from torch_geometric.io import read_npz

    path = SHARED_NPZ / f"{name}.npz"
    parsed = parse_npz(path.read_bytes())
    assert (parsed.labels.numel(), parsed.features.shape[1], len(parsed.class_names)) == (nodes, features, classes)
    assert parsed.edge_index.shape[1] == 2 * edges
    # The same undirected edges as PyTorch Geometric's reader.
    reference = read_npz(str(path)).edge_index
    assert set(map(tuple, reference.T.tolist())) == set(map(tuple, parsed.edge_index.T.tolist()))
