"""stages.download, run in-process against the loopback server, with a throwaway MLflow store."""

from __future__ import annotations

import base64
import re
import shutil
import sys
from pathlib import Path

import mlflow
import pytest
from conftest import LoopbackServer, PlanetoidFolder, run_stage_in_process

from gat import datasets
from stages import download
from stages.support import fetch
from stages.support.params import StageError, load_params
from stages.support.store import DATA_EXPERIMENT, connect

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planetoid_folder: PlanetoidFolder) -> Path:
    """A folder with the repo's params.yaml, a private MLflow store, and the folder's checksums pinned."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(datasets, "CHECKSUMS", planetoid_folder.path / "SHA256SUMS")
    monkeypatch.setattr(datasets, "SIZES", planetoid_folder.sizes)
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.0)
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
    # params.yaml's keys as params.yaml spells them; `dataset` and `source` are not in it, so keep plain names.
    assert set(run.data.params) == {"dataset", "source", "download.base_url", "download.timeout_s",
                                    "download.retries"}
    assert run.data.params["download.retries"] == str(load_params(workdir / "params.yaml").download.retries)
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


def _main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The stage as `python -m stages.download` runs it: (exit code, stdout, stderr)."""
    code = run_stage_in_process(monkeypatch, "stages.download", download.run, *args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _logged_values(run: mlflow.entities.Run) -> list[str]:
    return [*run.data.params.values(), *run.data.tags.values()]


def test_a_mirror_password_never_reaches_the_output_errors_or_mlflow(
        workdir: Path, planetoid_folder: PlanetoidFolder, serve_folder, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    params = workdir / "params.yaml"
    params.write_text(re.sub(r"base_url: https://", "base_url: https://gh-user:b4se-s3cret@", params.read_text()))
    good = serve_folder(planetoid_folder.path)
    monkeypatch.setenv("GAT_DATA_MIRROR", good.base_url.replace("http://", "http://mirror-user:s3cret@"))
    code, out, err = _main(monkeypatch, capsys, "--dataset", "cora", "--out", "data/raw/cora")
    assert code == 0 and "from http://mirror-user:***@127.0.0.1:" in out
    assert good.authorizations[0] == "Basic " + base64.b64encode(b"mirror-user:s3cret").decode()

    broken = serve_folder(planetoid_folder.path, faults={"ind.cora.ty": ["404"]})
    monkeypatch.setenv("GAT_DATA_MIRROR", broken.base_url.replace("http://", "http://mirror-user:s3cret@"))
    failed_code, failed_out, failed_err = _main(monkeypatch, capsys, "--dataset", "cora", "--out", "data/raw/cora")
    assert failed_code == 2 and "HTTP 404 Not Found for http://mirror-user:***@127.0.0.1:" in failed_err

    assert "s3cret" not in out + err + failed_out + failed_err
    runs = {run.info.status: run for run in _runs()}
    assert runs.keys() == {"FINISHED", "FAILED"}
    assert runs["FINISHED"].data.params["source"] == good.base_url.replace("http://", "http://mirror-user:***@")
    assert runs["FINISHED"].data.params["download.base_url"].startswith("https://gh-user:***@")
    assert not [value for run in runs.values() for value in _logged_values(run) if "s3cret" in value]


def test_a_redirect_loop_is_one_line_and_exit_code_2(
        workdir: Path, planetoid_folder: PlanetoidFolder, serve_folder, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    server: LoopbackServer = serve_folder(planetoid_folder.path, faults={"ind.cora.allx": ["redirect-loop"]})
    monkeypatch.setenv("GAT_DATA_MIRROR", server.base_url)
    connect(DATA_EXPERIMENT)  # a fresh store's creation is logged to stderr; this test wants only the stage's lines
    capsys.readouterr()
    code, _, err = _main(monkeypatch, capsys, "--dataset", "cora", "--out", "data/raw/cora")
    assert code == 2
    assert re.fullmatch(r"error: http://127\.0\.0\.1:\d+/data/ind\.cora\.allx redirects in a loop \(more than 30 "
                        r"redirects; not retried\): check download\.base_url in params\.yaml or GAT_DATA_MIRROR.*\n",
                        err)
    assert list((workdir / "data/raw").iterdir()) == []
    (run,) = _runs()
    assert run.info.status == "FAILED"
