"""stages.preprocess, run in-process on a downloaded folder, with a throwaway MLflow store."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from conftest import PlanetoidFolder, run_stage_in_process

from gat import data, datasets
from gat.data import graph_from_tensors
from gat.datasets import file_names
from stages import preprocess
from stages.support import fetch
from stages.support.params import StageError
from stages.support.store import DATA_EXPERIMENT

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planetoid_folder: PlanetoidFolder) -> Path:
    """The repo's params.yaml, cora's raw files, a private MLflow store, the folder's checksums pinned."""
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(datasets, "CHECKSUMS", planetoid_folder.path / "SHA256SUMS")
    monkeypatch.setattr(datasets, "SIZES", planetoid_folder.sizes)
    raw = tmp_path / "data/raw/cora"
    raw.mkdir(parents=True)
    expected = datasets.DATASETS["cora"].checksums()
    fetch.fetch(expected, planetoid_folder.path, raw, sizes=datasets.DATASETS["cora"].sizes(), timeout_s=5, retries=0)
    return tmp_path


def _run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["stages.preprocess", "--dataset", "cora", "--raw", "data/raw/cora",
                                      "--out", "data/prepared/cora"])
    preprocess.run()


def test_standard_split(workdir: Path, planetoid_folder: PlanetoidFolder, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(monkeypatch)
    out = workdir / "data/prepared/cora"
    meta = json.loads((out / "meta.json").read_text())
    graph = graph_from_tensors(torch.load(out / "graph.pt", weights_only=True))
    assert meta["num_nodes"] == graph.num_nodes and meta["split"] == {"name": "standard"}
    assert meta["splits"]["train"]["count"] == 140 and meta["splits"]["val"]["count"] == 500
    assert meta["source_sha256"] == {name: planetoid_folder.checksums[name] for name in file_names("cora")}
    (run,) = mlflow.search_runs(experiment_names=[DATA_EXPERIMENT], output_format="list")
    assert run.info.status == "FINISHED" and run.data.metrics["num_nodes"] == graph.num_nodes
    assert run.inputs.dataset_inputs[0].dataset.name == "cora"


def test_random_split_from_params(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = workdir / "params.yaml"
    # Sizes that fit the synthetic files too (1,140 labelled nodes) when ../shared is absent.
    text = params.read_text().replace("split: standard", "split: random")
    for key, size in (("train", 300), ("val", 200), ("test", 400)):
        text = re.sub(rf"random_{key}_size: \d+", f"random_{key}_size: {size}", text)
    params.write_text(text)
    _run(monkeypatch)
    meta = json.loads((workdir / "data/prepared/cora/meta.json").read_text())
    assert meta["split"] == {"name": "random", "seed": 0, "train_size": 300, "val_size": 200, "test_size": 400}
    assert {name: part["count"] for name, part in meta["splits"].items()} == {"train": 300, "val": 200, "test": 400}


def test_tampered_raw_file_is_refused_before_unpickling(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (workdir / "data/raw/cora/ind.cora.graph").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(StageError, match=r"ind\.cora\.graph: SHA-256"):
        _run(monkeypatch)
    assert not (workdir / "data/prepared").exists()


def test_missing_raw_folder_names_the_stage(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["stages.preprocess", "--dataset", "cora", "--raw", "nowhere", "--out", "x"])
    with pytest.raises(StageError, match="dvc repro download@cora"):
        preprocess.run()


def _main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The stage as `python -m stages.preprocess` runs it: (exit code, stderr)."""
    code = run_stage_in_process(monkeypatch, "stages.preprocess", preprocess.run, "--dataset", "cora",
                                "--raw", "data/raw/cora", "--out", "data/prepared/cora")
    return code, capsys.readouterr().err


def _replace_raw_file(workdir: Path, monkeypatch: pytest.MonkeyPatch, name: str, content: bytes) -> None:
    """Put `content` in place of raw file `name` and pin its checksum, as a mirror and a re-pinned list would."""
    (workdir / "data/raw/cora" / name).write_bytes(content)
    pinned = datasets.pinned_checksums() | {name: hashlib.sha256(content).hexdigest()}
    checksums = workdir / "SHA256SUMS"
    checksums.write_text("".join(f"{digest}  {file}\n" for file, digest in pinned.items()))
    monkeypatch.setattr(datasets, "CHECKSUMS", checksums)


def _with_nan_feature(raw: Path) -> bytes:
    features = data.restricted_unpickle((raw / "ind.cora.tx").read_bytes(), "ind.cora.tx", object)
    features.data[0] = float("nan")
    return pickle.dumps(features, protocol=4)


def _with_duplicate_test_id(raw: Path) -> bytes:
    ids = (raw / "ind.cora.test.index").read_bytes().split()
    return b"\n".join([ids[0], *ids[:-1]]) + b"\n"


def _graph_of(raw: Path, change) -> bytes:
    """ind.cora.graph with `change` applied to its dict of node -> neighbour list."""
    adjacency = data.restricted_unpickle((raw / "ind.cora.graph").read_bytes(), "ind.cora.graph", dict)
    return pickle.dumps(change(adjacency), protocol=4)


@pytest.mark.parametrize("name, content, problem", [
    ("ind.cora.graph", lambda raw: b"cos\nsystem\n(S'echo pwned'\ntR.",
     r"ind\.cora\.graph: refusing to load os\.system"),
    ("ind.cora.allx", lambda raw: (raw / "ind.cora.allx").read_bytes()[:100],
     r"ind\.cora\.allx: pickle data was truncated"),
    ("ind.cora.y", lambda raw: pickle.dumps({"not": "an array"}, protocol=2),
     r"ind\.cora\.y: expected a pickled ndarray, found dict"),
    ("ind.cora.test.index", lambda raw: b"12\nabc\n", r"ind\.cora\.test\.index: 'abc' is not a node id"),
    ("ind.cora.test.index", _with_duplicate_test_id, r"ind\.cora\.test\.index: node \d+ is listed 2 times"),
    ("ind.cora.tx", _with_nan_feature, r"ind\.cora\.tx: 1 NaN or infinite feature value\(s\)"),
    ("ind.cora.graph", lambda raw: _graph_of(raw, lambda graph: {node: [node] for node in graph}),
     r"ind\.cora\.graph: holds no edges between distinct nodes \(only self-loops, or none\)"),
    ("ind.cora.graph", lambda raw: _graph_of(raw, lambda graph: {str(node): ids for node, ids in graph.items()}),
     r"ind\.cora\.graph: the key '0' is a str, not a node id"),
    ("ind.cora.graph", lambda raw: _graph_of(raw, lambda graph: {node: [str(i) for i in ids]
                                                                 for node, ids in graph.items()}),
     r"ind\.cora\.graph: node \d+'s neighbour '\d+' is a str, not a node id"),
], ids=["refused-class", "truncated", "wrong-type", "not-an-integer", "duplicate-test-id", "nan-feature",
        "self-loops-only", "string-keys", "string-neighbours"])
def test_a_refused_raw_file_is_one_line_naming_it_and_the_fix(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str,
        content, problem: str) -> None:
    _replace_raw_file(workdir, monkeypatch, name, content(workdir / "data/raw/cora"))
    code, err = _main(monkeypatch, capsys)
    assert code == 2
    assert re.fullmatch(rf"error: data/raw/cora: {problem}.*fix or unset GAT_DATA_MIRROR, and run "
                        r"`dvc repro --force download@cora`\.\n", err), err
    assert not (workdir / "data/prepared").exists()


def test_mlflow_gets_params_yaml_keys_and_no_password(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = workdir / "params.yaml"
    params.write_text(re.sub(r"base_url: https://", "base_url: https://gh-user:s3cret@", params.read_text()))
    _run(monkeypatch)
    (run,) = mlflow.search_runs(experiment_names=[DATA_EXPERIMENT], output_format="list")
    # `dataset` is not a params.yaml key, so it keeps its plain name.
    assert set(run.data.params) == {"dataset", "preprocess.split", "preprocess.random_seed",
                                    "preprocess.random_train_size", "preprocess.random_val_size",
                                    "preprocess.random_test_size"}
    source = run.inputs.dataset_inputs[0].dataset.source
    assert "gh-user:***@" in source and "s3cret" not in source
