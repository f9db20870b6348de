"""npz graphs of params.yaml's `graphs` through the stages: params validation, download (loopback URL or local path,
checksum-verified), preprocess (the Pitfalls split; a malformed file refused in one line, exit 2, nothing written),
and the chain on the real gnn-benchmark files of ../shared when present."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import mlflow
import numpy as np
import pytest
import yaml
from conftest import LoopbackServer, run_stage_in_process
from test_npz import npz_arrays, npz_bytes

from gat.config import Params, ParamsError
from stages import download, evaluate, preprocess, report, reproduce, train
from stages.support import fetch
from stages.support.params import parse_params_yaml
from stages.support.store import DATA_EXPERIMENT, REPRODUCE_EXPERIMENT

REPO = Path(__file__).resolve().parents[1]
SHARED_NPZ = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "npz"


def repo_params() -> dict[str, Any]:
    return parse_params_yaml((REPO / "params.yaml").read_text())


def with_graph(raw: dict[str, Any], name: str, source: str, sha256: str, split_seed: int = 0,
               listed: bool = True) -> dict[str, Any]:
    """`raw` with the graph `name` in `graphs` (and, `listed`, in `datasets`, with the paper's protocol block)."""
    raw["graphs"] = {**raw["graphs"], name: {"source": source, "sha256": sha256, "split_seed": split_seed}}
    if listed:
        raw["datasets"] = [*raw["datasets"], name]
        raw["reproduce"]["protocol"][name] = raw["reproduce"]["protocol"]["cora"]
    return raw


# Params -----------------------------------------------------------------------------------------------------------

def test_the_shipped_example_graphs_validate_and_are_not_listed() -> None:
    params = Params.from_dict(repo_params())
    assert set(params.graphs) == {"cora_npz", "citeseer_npz"} and params.datasets == ("cora", "citeseer")
    assert params.graphs["cora_npz"].sha256 == "068e22d90c3849b4057dfb05851741428992af058efcd4e7ebb4186f3d581de2"


@pytest.mark.parametrize("change, key", [
    (lambda raw: raw.update(datasets=["cora", "mine"]), r"`datasets\[1\]` must be a Planetoid dataset or a key"),
    (lambda raw: with_graph(raw, "cora", "x.npz", "ab" * 32, listed=False), r"`graphs.cora` is also a Planetoid"),
    (lambda raw: with_graph(raw, "Bad Name", "x.npz", "ab" * 32, listed=False), r"`graphs.Bad Name` must be a name"),
    (lambda raw: with_graph(raw, "mine", "x.npz", "AB" * 32), r"`graphs.mine.sha256` must be 64 lowercase hex"),
    (lambda raw: with_graph(raw, "mine", "ftp://host/x.npz", "ab" * 32), r"`graphs.mine.source` must be an http"),
    (lambda raw: with_graph(raw, "mine", "x.npz", "ab" * 32, split_seed=-1), r"`graphs.mine.split_seed` must be in"),
    (lambda raw: raw["graphs"]["cora_npz"].pop("sha256"), r"`graphs.cora_npz.sha256` is missing"),
    (lambda raw: raw["graphs"]["cora_npz"].update(extra=1), r"`graphs.cora_npz.extra` is not a known key"),
    (lambda raw: raw["reproduce"]["protocol"].update(nowhere=raw["reproduce"]["protocol"]["cora"]),
     r"`reproduce.protocol.nowhere` is not a dataset"),
    (lambda raw: raw.pop("graphs"), r"`graphs` is missing"),
])
def test_params_refused_naming_the_key(change: Callable[[dict], Any], key: str) -> None:
    raw = repo_params()
    change(raw)
    with pytest.raises(ParamsError, match=key):
        Params.from_dict(raw)


def test_a_listed_graph_needs_its_protocol_block() -> None:
    raw = with_graph(repo_params(), "mine", "x.npz", "ab" * 32)
    del raw["reproduce"]["protocol"]["mine"]
    with pytest.raises(ParamsError, match=r"`reproduce.protocol.mine` is missing"):
        Params.from_dict(raw)


# The stages -------------------------------------------------------------------------------------------------------

@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository root (DVC_ROOT, so relative graph paths resolve here) with a private MLflow store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.0)
    return tmp_path


def write_params(folder: Path, name: str, source: str, sha256: str, **overrides: Any) -> None:
    raw = with_graph(repo_params(), name, source, sha256)
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        block = raw
        for part in path:
            block = block[part]
        block[last] = value
    (folder / "params.yaml").write_text(yaml.safe_dump(raw))


def _stage(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module: Any,
           *args: str) -> tuple[int, str, str]:
    code = run_stage_in_process(monkeypatch, f"stages.{module.__name__.rsplit('.', 1)[-1]}", module.run, *args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _download(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str = "mine"):
    return _stage(monkeypatch, capsys, download, "--dataset", name, "--out", f"data/raw/{name}")


def _preprocess(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str = "mine"):
    return _stage(monkeypatch, capsys, preprocess, "--dataset", name, "--raw", f"data/raw/{name}",
                  "--out", f"data/prepared/{name}")


def ring_graph_bytes(sizes: tuple[int, ...] = (60, 70, 30)) -> bytes:
    """A ring of sum(sizes) nodes, class c holding sizes[c] of them; random binary features."""
    n = sum(sizes)
    labels = np.repeat(np.arange(len(sizes)), sizes).astype(np.int16)
    rng = np.random.default_rng(0)
    attributes = (rng.random((n, 12)) < 0.3).astype(np.float32)
    attributes[:, 0] = 1  # no empty row
    from scipy import sparse
    ring = sparse.csr_matrix((np.ones(n, np.float32), (np.arange(n), (np.arange(n) + 1) % n)), shape=(n, n))
    csr = sparse.csr_matrix(attributes)
    return npz_bytes({"adj_data": ring.data, "adj_indices": ring.indices, "adj_indptr": ring.indptr,
                      "adj_shape": np.array(ring.shape), "attr_data": csr.data, "attr_indices": csr.indices,
                      "attr_indptr": csr.indptr, "attr_shape": np.array(csr.shape), "labels": labels,
                      "class_names": np.array([f"class {c}" for c in range(len(sizes))])})


def test_download_over_http_then_preprocess_with_the_split_seed(
        workdir: Path, serve_folder: Callable[..., LoopbackServer], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    served = workdir / "served"
    served.mkdir()
    data = ring_graph_bytes()
    (served / "mine.npz").write_bytes(data)
    server = serve_folder(served)
    write_params(workdir, "mine", f"{server.base_url}/mine.npz", hashlib.sha256(data).hexdigest(),
                 **{"graphs.mine.split_seed": 7})
    code, out, err = _download(monkeypatch, capsys)
    assert code == 0, err
    assert [path.name for path in (workdir / "data/raw/mine").iterdir()] == ["graph.npz"]
    assert (workdir / "data/raw/mine/graph.npz").read_bytes() == data
    code, out, err = _preprocess(monkeypatch, capsys)
    assert code == 0, err
    assert "class 2 (30 nodes)" in out and "split seed 7" in out
    meta = json.loads((workdir / "data/prepared/mine/meta.json").read_text())
    assert meta["class_names"] == ["class 0", "class 1"] and meta["num_classes"] == 2
    assert meta["split"] == {"name": "pitfalls", "seed": 7, "train_per_class": 20, "val_per_class": 30,
                             "dropped_classes": {"class 2": 30}}
    assert meta["splits"]["train"]["per_class"] == [20, 20] and meta["splits"]["test"]["per_class"] == [10, 20]
    runs = mlflow.search_runs(experiment_names=[DATA_EXPERIMENT], output_format="list")
    assert sorted(run.info.run_name for run in runs) == ["download-mine", "preprocess-mine"]
    for run in runs:
        assert run.info.status == "FINISHED" and run.data.tags["split_seed"] == "7"
        assert run.data.params["graphs.mine.split_seed"] == "7"


def test_a_local_relative_path_is_copied_from_the_repository_root(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "graphs").mkdir()
    data = ring_graph_bytes()
    (workdir / "graphs/mine.npz").write_bytes(data)
    write_params(workdir, "mine", "graphs/mine.npz", hashlib.sha256(data).hexdigest())
    elsewhere = workdir / "elsewhere"  # DVC_ROOT, not the working folder, is the root
    elsewhere.mkdir()
    (elsewhere / "params.yaml").write_text((workdir / "params.yaml").read_text())
    monkeypatch.chdir(elsewhere)
    code, _out, err = _download(monkeypatch, capsys)
    assert code == 0, err
    assert (elsewhere / "data/raw/mine/graph.npz").read_bytes() == data


def test_a_wrong_sha256_names_the_actual_digest_and_writes_nothing(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    data = ring_graph_bytes()
    (workdir / "mine.npz").write_bytes(data)
    write_params(workdir, "mine", "mine.npz", "ab" * 32)
    code, out, err = _download(monkeypatch, capsys)
    actual = hashlib.sha256(data).hexdigest()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"set `graphs.mine.sha256: {actual}` in params.yaml" in err
    assert not (workdir / "data/raw/mine").exists()
    (run,) = mlflow.search_runs(experiment_names=[DATA_EXPERIMENT], output_format="list")
    assert run.info.status == "FAILED"


def test_a_missing_local_file_is_one_line(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    write_params(workdir, "mine", "nowhere/mine.npz", "ab" * 32)
    code, _out, err = _download(monkeypatch, capsys)
    assert code == 2 and "graphs.mine.source:" in err and "is not a file" in err


def test_an_unknown_dataset_is_one_line(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    write_params(workdir, "mine", "mine.npz", "ab" * 32)
    code, _out, err = _download(monkeypatch, capsys, "nothing")
    assert code == 2 and "'nothing' is neither a Planetoid dataset" in err


def _bad(**changes: Any) -> bytes:
    arrays = npz_arrays()
    arrays.update(changes)
    return npz_bytes(arrays)


@pytest.mark.parametrize("data, field", [
    (b"PK\x03\x04 not really a zip", "not an npz archive"),
    (_bad(labels=np.array([0, 1, 0, 5, 0, 1], np.int8)), "class_names: 2 names, but labels go up to 5"),
    (_bad(attr_data=np.full(8, np.nan, np.float32)), "attr_data: 8 NaN"),
    (_bad(adj_shape=np.array([6, 6, 6])), "adj_shape: expected two"),
    (_bad(class_names=np.array([object(), "b"], dtype=object)), "class_names: a pickled"),
])
def test_a_malformed_graph_is_refused_in_one_line_with_nothing_written(
        data: bytes, field: str, workdir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    raw = workdir / "data/raw/mine"
    raw.mkdir(parents=True)
    (raw / "graph.npz").write_bytes(data)  # as download leaves it: the sha256 matches, the content is bad
    write_params(workdir, "mine", "mine.npz", hashlib.sha256(data).hexdigest())
    code, _out, err = _preprocess(monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert field in err and "graph.npz" in err
    assert not (workdir / "data/prepared").exists()


# The chain on the real files ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not SHARED_NPZ.is_dir(), reason="needs the real npz files in ../shared/datasets/npz")
def test_chain_on_the_real_files(workdir: Path, serve_folder: Callable[..., LoopbackServer],
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """download -> preprocess -> train (a few epochs) -> evaluate -> reproduce (2 seeds) -> report, on cora.npz and
    citeseer.npz served over loopback."""
    server = serve_folder(SHARED_NPZ)
    sums = dict(reversed(line.split()) for line in (SHARED_NPZ / "SHA256SUMS").read_text().splitlines())
    raw = repo_params()
    for name in ("cora", "citeseer"):
        raw["graphs"][f"{name}_npz"] = {"source": f"{server.base_url}/{name}.npz", "sha256": sums[f"{name}.npz"],
                                        "split_seed": 0}
    raw["datasets"] = ["cora_npz", "citeseer_npz"]
    raw["train"]["dataset"] = "cora_npz"
    raw["train"]["optim"]["max_epochs"] = 5
    raw["reproduce"].update(seeds=2, workers=1, seeds_per_batch=2)
    for name in raw["datasets"]:
        raw["reproduce"]["protocol"][name]["optim"]["max_epochs"] = 5
    (workdir / "params.yaml").write_text(yaml.safe_dump(raw))

    for name, nodes, features, classes in (("cora_npz", 2708, 1433, 7), ("citeseer_npz", 3312, 3703, 6)):
        assert _download(monkeypatch, capsys, name)[0] == 0
        code, out, err = _preprocess(monkeypatch, capsys, name)
        assert code == 0, err
        assert f"{nodes:,} nodes" in out and f"{features:,} features, {classes} classes" in out
        code, out, err = _stage(monkeypatch, capsys, reproduce, "--dataset", name, "--data", f"data/prepared/{name}",
                                "--out", f"data/reproduce/{name}")
        assert code == 0, err
        assert "no published result" in out
        summary = json.loads((workdir / f"data/reproduce/{name}/summary.json").read_text())
        assert summary["seeds"] == 2 and summary["paper"] is None and summary["inside_paper_band"] is None
    code, out, err = _stage(monkeypatch, capsys, train, "--data", "data/prepared/cora_npz", "--out", "data/train")
    assert code == 0, err
    code, out, err = _stage(monkeypatch, capsys, evaluate, "--data", "data/prepared/cora_npz", "--train", "data/train",
                            "--out", "data/eval")
    assert code == 0, err
    per_class = json.loads((workdir / "data/eval/per_class.json").read_text())
    assert per_class["0"]["name"] == "Case_Based" and per_class["6"]["name"] == "Theory"
    code, out, err = _stage(monkeypatch, capsys, report, "--reproduced", "data/reproduce",
                            "--markdown", "reproduction.md", "--metrics", "reproduction.json")
    assert code == 0, err
    assert "no published result" in (workdir / "reproduction.md").read_text()
    for run in mlflow.search_runs(experiment_names=[REPRODUCE_EXPERIMENT], output_format="list"):
        assert run.data.tags["split_seed"] == "0"
