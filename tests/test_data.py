"""gat.data: the restricted unpickler, Planetoid assembly, splits and the tensor round trip."""

from __future__ import annotations

import codecs
import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SYNTHETIC_LAYOUTS, PlanetoidFolder, SyntheticPlanetoid, write_synthetic_planetoid

from gat import data
from gat.datasets import PARTS, file_names
from gat.data import Graph, describe, graph_from_tensors, graph_to_tensors, parse_planetoid, random_split


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
    assert len(file_names("citeseer")) == len(PARTS) == 8


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


@pytest.fixture(scope="module")
def cora_raw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Synthetic cora's eight files, as bytes: each test changes its own copy."""
    folder = tmp_path_factory.mktemp("cora")
    write_synthetic_planetoid(folder, "cora", **SYNTHETIC_LAYOUTS["cora"])
    return _read(folder, "cora")


def _load(raw: dict[str, bytes], name: str) -> object:
    return data.restricted_unpickle(raw[name], name, object)


def _pickled(value: object) -> bytes:
    # Protocol 4 writes bytes as bytes, without `_codecs.encode`, so these files parse on any version.
    return pickle.dumps(value, protocol=4)


def _test_ids(raw: dict[str, bytes]) -> list[int]:
    return [int(token) for token in raw["ind.cora.test.index"].split()]


def _with_test_ids(raw: dict[str, bytes], ids: list[int]) -> dict[str, bytes]:
    return raw | {"ind.cora.test.index": "".join(f"{i}\n" for i in ids).encode()}


def test_python3_protocol_2_pickles_of_the_arrays_parse_identically(cora_raw: dict[str, bytes]) -> None:
    # Python 3 writes their bytes at protocol 2 as `_codecs.encode(str, "latin1")` calls.
    repickled = {name: pickle.dumps(_load(cora_raw, name), protocol=2) if not name.endswith("test.index") else raw
                 for name, raw in cora_raw.items()}
    assert b"_codecs" in repickled["ind.cora.allx"]
    original, again = parse_planetoid(cora_raw, "cora"), parse_planetoid(repickled, "cora")
    assert torch.equal(original.features.to_dense(), again.features.to_dense())
    for name in ("edge_index", "labels", "train_idx", "val_idx", "test_idx"):
        assert torch.equal(getattr(original, name), getattr(again, name))


class _Encode:
    """Pickles as a call to `_codecs.encode(*args)`."""

    def __init__(self, *args: object) -> None:
        self.args = args

    def __reduce__(self):
        return (codecs.encode, self.args)


@pytest.mark.parametrize("args", [("abc", "utf-8"), ("abc", "rot13"), (b"abc", "latin1"), ("abc", "latin1", "strict")])
def test_codecs_encode_is_refused_except_for_latin1_byte_strings(args: tuple[object, ...]) -> None:
    assert data.restricted_unpickle(pickle.dumps(_Encode("ab\xff", "latin1"), protocol=2), "ok", bytes) == b"ab\xff"
    with pytest.raises(pickle.UnpicklingError, match=r"ind\.cora\.y: refusing _codecs\.encode"):
        data.restricted_unpickle(pickle.dumps(_Encode(*args), protocol=2), "ind.cora.y", bytes)


@pytest.mark.parametrize("bad, message", [
    (b"\x80\x02cnumpy\n", r"ind\.cora\.ally: pickle data was truncated"),
    (b"not a pickle at all", r"ind\.cora\.ally: "),
    (pickle.dumps([[0, 1]], protocol=2), r"ind\.cora\.ally: expected a pickled ndarray, found list"),
])
def test_unreadable_pickles_are_refused_naming_the_file(cora_raw: dict[str, bytes], bad: bytes, message: str) -> None:
    with pytest.raises((ValueError, pickle.UnpicklingError), match=message):
        parse_planetoid(cora_raw | {"ind.cora.ally": bad}, "cora")


@pytest.mark.parametrize("text, message", [
    (b"", "holds no test node ids"),
    (b"640\nabc\n", "'abc' is not a node id"),
    (b"640\n-641\n", "'-641' is not a node id"),
    (b"640\n" + b"9" * 40 + b"\n", "is not a node id"),
])
def test_unreadable_test_index_is_refused(cora_raw: dict[str, bytes], text: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=rf"ind\.cora\.test\.index: .*{message}"):
        parse_planetoid(cora_raw | {"ind.cora.test.index": text}, "cora")


def test_a_test_id_far_outside_the_graph_is_refused(cora_raw: dict[str, bytes]) -> None:
    ids = _test_ids(cora_raw)
    ids[ids.index(max(ids))] = 100_000
    with pytest.raises(ValueError, match=r"ind\.cora\.test\.index: the test ids run up to node 100000"):
        parse_planetoid(_with_test_ids(cora_raw, ids), "cora")


def test_padding_within_the_tolerance_is_accepted(cora_raw: dict[str, bytes]) -> None:
    # Citeseer-like: ids missing inside the block are padded, up to MAX_PADDED_TEST_FRACTION of the test rows.
    ids = _test_ids(cora_raw)
    num_missing = int(data.MAX_PADDED_TEST_FRACTION * len(ids))
    top = max(ids)
    shifted = [i + num_missing if i > min(ids) else i for i in ids]  # a gap of num_missing after the first id
    assert parse_planetoid(_with_test_ids(cora_raw, shifted), "cora").num_nodes == top + num_missing + 1
    shifted = [i + 1 if i == max(shifted) else i for i in shifted]
    with pytest.raises(ValueError, match="at most 10% of the 200 test rows may be missing"):
        parse_planetoid(_with_test_ids(cora_raw, shifted), "cora")


def test_a_duplicate_test_id_is_refused(cora_raw: dict[str, bytes]) -> None:
    ids = _test_ids(cora_raw)
    ids[1] = ids[0]
    with pytest.raises(ValueError, match=rf"ind\.cora\.test\.index: node {ids[0]} is listed 2 times"):
        parse_planetoid(_with_test_ids(cora_raw, ids), "cora")


@pytest.mark.parametrize("part", ["tx", "allx", "x"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_feature_values_are_refused(cora_raw: dict[str, bytes], part: str, value: float) -> None:
    name = f"ind.cora.{part}"
    features = _load(cora_raw, name).copy()
    features.data[-1] = value
    with pytest.raises(ValueError, match=rf"{name}: 1 NaN or infinite feature value\(s\), the first in row "
                                         rf"{features.shape[0] - 1}"):
        parse_planetoid(cora_raw | {name: _pickled(features)}, "cora")


def test_a_malformed_csr_matrix_is_refused(cora_raw: dict[str, bytes]) -> None:
    features = _load(cora_raw, "ind.cora.tx").copy()
    features.indices[0] = features.shape[1] + 5  # a column beyond the matrix
    with pytest.raises(ValueError, match=r"ind\.cora\.tx: not a well-formed CSR matrix"):
        parse_planetoid(cora_raw | {"ind.cora.tx": _pickled(features)}, "cora")


@pytest.mark.parametrize("part, row, kind", [("y", 3, "training"), ("ally", 3, "training or validation"),
                                             ("ally", 140 + 499, "training or validation"), ("ty", 7, "test")])
def test_an_unlabelled_node_in_the_standard_split_is_refused(cora_raw: dict[str, bytes], part: str, row: int,
                                                             kind: str) -> None:
    name = f"ind.cora.{part}"
    labels = _load(cora_raw, name).copy()
    labels[row] = 0
    message = rf"{name}: row {row} is all zero \(1 of the first \d+ rows are\), but every {kind} node"
    with pytest.raises(ValueError, match=message):
        parse_planetoid(cora_raw | {name: _pickled(labels)}, "cora")


def test_an_unlabelled_node_outside_the_standard_split_is_accepted(cora_raw: dict[str, bytes]) -> None:
    labels = _load(cora_raw, "ind.cora.ally").copy()
    labels[-1] = 0  # the last allx node: after the 500 validation nodes, in no split
    graph = parse_planetoid(cora_raw | {"ind.cora.ally": _pickled(labels)}, "cora")
    assert graph.labels[len(labels) - 1] == -1
    assert describe(graph)["splits"]["val"]["count"] == 500


@pytest.mark.parametrize("change, message", [
    (lambda labels: labels * 2, "holds values other than 0 and 1"),
    (lambda labels: labels.astype(np.float64) * np.nan, "holds values other than 0 and 1"),
    (lambda labels: np.ones_like(labels), "row 0 has more than one 1"),
    (lambda labels: labels[:, :-1], r"6 class columns, but ind\.cora\.ally has 7"),
    (lambda labels: labels.argmax(axis=1), "expected a 2-D array of one-hot labels"),
])
def test_malformed_label_arrays_are_refused(cora_raw: dict[str, bytes], change, message: str) -> None:
    labels = change(_load(cora_raw, "ind.cora.y"))
    with pytest.raises(ValueError, match=rf"ind\.cora\.y: {message}"):
        parse_planetoid(cora_raw | {"ind.cora.y": _pickled(labels)}, "cora")


def test_a_malformed_graph_is_refused(cora_raw: dict[str, bytes]) -> None:
    adjacency = _load(cora_raw, "ind.cora.graph")
    adjacency[0] = None
    with pytest.raises(ValueError, match=r"ind\.cora\.graph: expected a mapping of node ids to lists of node ids"):
        parse_planetoid(cora_raw | {"ind.cora.graph": _pickled(adjacency)}, "cora")
