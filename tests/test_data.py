"""gat.data: the restricted unpickler, Planetoid assembly, splits and the tensor round trip."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SYNTHETIC_LAYOUTS, PlanetoidFolder, SyntheticPlanetoid, write_synthetic_planetoid
from gat import data
from gat.data import Graph, describe, file_names, graph_from_tensors, graph_to_tensors, parse_planetoid, random_split


def _read(folder: Path, dataset: str) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in file_names(dataset)}


@pytest.fixture(scope="module", params=sorted(SYNTHETIC_LAYOUTS))
def synthetic(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[SyntheticPlanetoid, Graph]:
    folder = tmp_path_factory.mktemp("synthetic")
    truth = write_synthetic_planetoid(folder, request.param, **SYNTHETIC_LAYOUTS[request.param])
    return truth, parse_planetoid(_read(folder, request.param), request.param)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_file_names_follow_parts() -> None:
    assert file_names("cora")[0] == "ind.cora.x"
    assert file_names("cora")[-1] == "ind.cora.test.index"
    assert len(file_names("citeseer")) == len(data.PARTS) == 8


def test_unpickler_refuses_code_execution() -> None:
    raw = {name: b"" for name in file_names("cora")}
    raw["ind.cora.x"] = pickle.dumps(_Exploit(), protocol=2)
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load (posix|nt|os)\.system"):
        parse_planetoid(raw, "cora")


def test_unpickler_resolves_the_python2_names_of_the_originals() -> None:
    unpickler = data._RestrictedUnpickler(io.BytesIO(b""))
    assert unpickler.find_class("numpy.core.multiarray", "_reconstruct") is data._RECONSTRUCT
    assert unpickler.find_class("scipy.sparse.csr", "csr_matrix").__name__ == "csr_matrix"
    assert unpickler.find_class("__builtin__", "list") is list
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        unpickler.find_class("builtins", "eval")


def test_missing_file_is_named() -> None:
    with pytest.raises(ValueError, match="ind.cora.graph"):
        parse_planetoid({name: b"" for name in file_names("cora") if not name.endswith("graph")}, "cora")


def test_counts_labels_and_split_match_the_ground_truth(synthetic: tuple[SyntheticPlanetoid, Graph]) -> None:
    truth, graph = synthetic
    assert graph.num_nodes == len(truth.labels)
    assert graph.num_features == truth.features.shape[1]
    assert graph.num_classes == truth.num_classes
    assert torch.equal(graph.labels, torch.from_numpy(truth.labels))
    assert graph.edge_index.shape[1] == 2 * len(truth.edges)
    assert torch.equal(graph.train_idx, torch.from_numpy(truth.train_idx))
    assert torch.equal(graph.val_idx, torch.from_numpy(truth.val_idx))
    assert torch.equal(graph.test_idx, torch.from_numpy(truth.test_idx))
    assert (graph.train_idx.numel(), graph.val_idx.numel(), graph.test_idx.numel()) == (
        20 * truth.num_classes, 500, SYNTHETIC_LAYOUTS[truth.dataset]["num_test"])


def test_features_are_the_truth_row_normalised(synthetic: tuple[SyntheticPlanetoid, Graph]) -> None:
    truth, graph = synthetic
    assert graph.features.layout == torch.sparse_csr and graph.features.dtype == torch.float32
    dense = graph.features.to_dense()
    sums = truth.features.sum(axis=1, keepdims=True)
    expected = np.divide(truth.features, sums, out=np.zeros_like(truth.features), where=sums != 0)
    torch.testing.assert_close(dense, torch.from_numpy(expected))
    row_sums = dense.sum(dim=1)
    assert ((row_sums - 1).abs() < 1e-5).logical_or(row_sums == 0).all()
    assert (row_sums == 0).any()  # the synthetic all-zero row stayed zero


def test_edges_are_symmetric_simple_and_sorted(synthetic: tuple[SyntheticPlanetoid, Graph]) -> None:
    truth, graph = synthetic
    source, target = graph.edge_index
    assert graph.edge_index.dtype == torch.int64
    assert (source != target).all()
    pairs = set(zip(source.tolist(), target.tolist()))
    assert len(pairs) == source.numel()
    assert pairs == {(j, i) for i, j in pairs}
    assert {(i, j) for i, j in pairs if i < j} == truth.edges
    key = target * graph.num_nodes + source
    assert (key[1:] > key[:-1]).all()


def test_padded_test_nodes_are_unlabelled_zero_and_in_no_split(synthetic: tuple[SyntheticPlanetoid, Graph]) -> None:
    truth, graph = synthetic
    padded = torch.nonzero(graph.labels < 0).flatten()
    assert padded.numel() == SYNTHETIC_LAYOUTS[truth.dataset]["missing_test"]
    assert (graph.features.to_dense()[padded] == 0).all()
    in_split = torch.cat([graph.train_idx, graph.val_idx, graph.test_idx])
    assert not torch.isin(padded, in_split).any()


def test_random_split_is_seeded_disjoint_and_labelled_only(synthetic: tuple[SyntheticPlanetoid, Graph]) -> None:
    _, graph = synthetic
    sizes = {"train_size": 100, "val_size": 200, "test_size": 300}
    first = random_split(graph.labels, seed=0, **sizes)
    again = random_split(graph.labels, seed=0, **sizes)
    other = random_split(graph.labels, seed=1, **sizes)
    assert all(torch.equal(a, b) for a, b in zip(vars(first).values(), vars(again).values()))
    assert not torch.equal(first.train_idx, other.train_idx)
    parts = [first.train_idx, first.val_idx, first.test_idx]
    assert [part.numel() for part in parts] == [100, 200, 300]
    assert all((part[1:] > part[:-1]).all() for part in parts)
    everything = torch.cat(parts)
    assert everything.unique().numel() == everything.numel()
    assert (graph.labels[everything] >= 0).all()


def test_random_split_rejects_sizes_beyond_the_labelled_nodes(synthetic: tuple[SyntheticPlanetoid, Graph]) -> None:
    _, graph = synthetic
    labelled = int((graph.labels >= 0).sum())
    with pytest.raises(ValueError, match=f"needs more than the {labelled} labelled nodes"):
        random_split(graph.labels, seed=0, train_size=labelled, val_size=1, test_size=0)


def test_tensors_round_trip_through_a_weights_only_load(synthetic: tuple[SyntheticPlanetoid, Graph],
                                                        tmp_path: Path) -> None:
    _, graph = synthetic
    torch.save(graph_to_tensors(graph), tmp_path / "graph.pt")
    loaded = graph_from_tensors(torch.load(tmp_path / "graph.pt", weights_only=True))
    assert torch.equal(loaded.features.to_dense(), graph.features.to_dense())
    for name in ("edge_index", "labels", "train_idx", "val_idx", "test_idx"):
        assert torch.equal(getattr(loaded, name), getattr(graph, name))
    assert loaded.num_classes == graph.num_classes
    with pytest.raises(ValueError, match="missing edge_index"):
        graph_from_tensors({k: v for k, v in graph_to_tensors(graph).items() if k != "edge_index"})


REAL_COUNTS = {
    # nodes, undirected edges, features, classes, (train, val, test)
    "cora": (2708, 5278, 1433, 7, (140, 500, 1000)),
    "citeseer": (3327, 4552, 3703, 6, (120, 500, 1000)),
}


@pytest.mark.parametrize("dataset", sorted(REAL_COUNTS))
def test_real_planetoid_counts(planetoid_folder: PlanetoidFolder, dataset: str) -> None:
    if not planetoid_folder.real:
        pytest.skip("the real Planetoid files (../shared/datasets/planetoid) are not here")
    graph = parse_planetoid(_read(planetoid_folder.path, dataset), dataset)
    summary = describe(graph)
    nodes, edges, features, classes, split = REAL_COUNTS[dataset]
    assert (summary["num_nodes"], summary["num_edges"], summary["num_features"], summary["num_classes"]) == (
        nodes, edges, features, classes)
    assert tuple(part["count"] for part in summary["splits"].values()) == split
    assert summary["splits"]["train"]["per_class"] == [20] * classes
    # Misplaced test rows would scramble labels against the graph; the published edge
    # homophily is 0.81 (Cora) and 0.74 (Citeseer).
    source, target = graph.edge_index
    assert (graph.labels[source] == graph.labels[target]).float().mean() > 0.7
