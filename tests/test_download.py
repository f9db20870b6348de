"""stages.download, run in-process against the loopback server, with a throwaway MLflow store."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlflow
import pytest

from conftest import LoopbackServer, PlanetoidFolder
from stages import _fetch, download
from stages._common import StageError
from stages._tracking import DATA_EXPERIMENT

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planetoid_folder: PlanetoidFolder) -> Path:
    """A folder with the repo's params.yaml, a private MLflow store, and the folder's checksums pinned."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(_fetch, "CHECKSUMS", planetoid_folder.path / "SHA256SUMS")
    monkeypatch.setattr(_fetch, "BACKOFF_S", 0.0)
    return tmp_path


def _run(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["stages.download", *args])
    download.run()


def _runs() -> list[mlflow.entities.Run]:
    return mlflow.search_runs(experiment_names=[DATA_EXPERIMENT], output_format="list")


def test_download_over_http_logs_a_finished_run(workdir: Path, planetoid_url: str, planetoid_folder: PlanetoidFolder,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAT_DATA_MIRROR", planetoid_url)
    _run(monkeypatch, "--dataset", "cora", "--out", "data/raw/cora")
    assert sorted(path.name for path in (workdir / "data/raw/cora").iterdir()) == sorted(
        name for name in planetoid_folder.checksums if name.startswith("ind.cora."))
    (run,) = _runs()
    assert run.info.status == "FINISHED" and run.info.run_name == "download-cora"
    assert run.data.params["source"] == planetoid_url
    assert run.data.tags["dataset"] == "cora" and len(run.data.tags["data_sha256"]) == 64
    assert run.data.metrics["total_bytes"] > 0


def test_failed_download_leaves_nothing_and_marks_the_run_failed(
        workdir: Path, planetoid_folder: PlanetoidFolder, serve_folder, monkeypatch: pytest.MonkeyPatch) -> None:
    server: LoopbackServer = serve_folder(planetoid_folder.path, faults={"ind.cora.ty": ["404"]})
    monkeypatch.setenv("GAT_DATA_MIRROR", server.base_url)
    with pytest.raises(StageError, match="HTTP 404"):
        _run(monkeypatch, "--dataset", "cora", "--out", "data/raw/cora")
    assert list((workdir / "data/raw").iterdir()) == []
    (run,) = _runs()
    assert run.info.status == "FAILED"
