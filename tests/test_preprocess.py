"""stages.preprocess, run in-process on a downloaded folder, with a throwaway MLflow store."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from conftest import PlanetoidFolder
from gat.data import file_names, graph_from_tensors
from stages import _fetch, preprocess
from stages._common import StageError
from stages._tracking import DATA_EXPERIMENT

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planetoid_folder: PlanetoidFolder) -> Path:
    """The repo's params.yaml, cora's raw files, a private MLflow store, the folder's checksums pinned."""
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(_fetch, "CHECKSUMS", planetoid_folder.path / "SHA256SUMS")
    raw = tmp_path / "data/raw/cora"
    raw.mkdir(parents=True)
    expected = _fetch.read_checksums(file_names("cora"))
    _fetch.fetch(expected, planetoid_folder.path, raw, timeout_s=5, retries=0)
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
