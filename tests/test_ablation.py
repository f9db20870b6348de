"""stages/ablation.py (`make ablation`) with its support modules (stages/support/ablation_cache.py, ablation_report.py,
ablation_runs.py and figures.ablation_figure): the report, the picture, the per-cell cache, the MLflow runs grouped
by invocation, cell and seed; a missing dataset refused in one line; an interrupt leaves nothing partial.

A synthetic Cora, 2 seeds and a few epochs. Most tests run the batches in this process (InlinePool) and
short-circuit the variants other than gat: each trains as gat does, its test accuracy shifted by a known amount
(VARIANT_SHIFT), so that the paired differences are known; the interrupt test runs the real command with its
worker processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlflow
import psutil
import pytest
import torch
from conftest import run_stage_in_process, write_prepared_synthetic_cora
from mlflow.tracking import MlflowClient

from benchmarks.scale import set_params
from gat.seeds import BatchResult
from gat.training import planned_kernel
from stages import ablation
from stages.support import seed_pool
from stages.support.local_pool import WORKER_NAME, WorkerPool
from stages.support.seed_task import train_seed_batch
from stages.support.store import ABLATION_EXPERIMENT, ABLATION_LEVEL

REPO = Path(__file__).resolve().parents[1]
VARIANT_SHIFT = {"gat": 0.0, "gatv2": 0.004, "constant": -0.01}
ARGS = ("--data", "data/prepared", "--cache", "data/ablation", "--report", "reports/ablation.md",
        "--plot", "reports/ablation.png")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """data/prepared/cora of a synthetic Cora, as the preprocess stage writes it."""
    root = tmp_path_factory.mktemp("ablation")
    write_prepared_synthetic_cora(root, {"ind.cora.x": "0" * 64})
    return root / "data"


@pytest.fixture
def workdir(prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch folder with the prepared data, tiny params (2 seeds of gat, a few epochs) and its own store."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data/prepared").symlink_to(prepared / "prepared")
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    set_params(tmp_path, **{"ablation.datasets": ["cora"], "ablation.variants": ["gat"], "ablation.seeds": 2,
                            "reproduce.seeds_per_batch": 1, "reproduce.protocol.cora.optim.max_epochs": 15,
                            "reproduce.protocol.cora.optim.patience": 5})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


class InlinePool(WorkerPool):
    """The batches in this process, one after another (no worker processes to start)."""

    def __init__(self) -> None:  # no executor: nothing to start
        self.size = 1

    def as_completed(self, function: Callable[..., Any], shared: Any,
                     jobs: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, Any]]:
        for index, job in enumerate(jobs):
            yield index, function(shared, *job)

    def __exit__(self, *error: object) -> None:
        pass


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[int]]]:
    """Batches run inline, every variant trained as gat with its test accuracy shifted by VARIANT_SHIFT; the
    (variant, seeds) of each batch trained, in order."""
    calls: list[tuple[str, list[int]]] = []

    def train(graph_tensors: Any, setup: Any, seeds: Sequence[int], device: torch.device) -> BatchResult:
        variant = setup.model.attention
        calls.append((variant, list(seeds)))
        as_gat = dataclasses.replace(setup, model=dataclasses.replace(setup.model, attention="gat"))
        result = train_seed_batch(graph_tensors, as_gat, seeds, device)
        rows = [{**row, "test_acc": row["test_acc"] + VARIANT_SHIFT[variant]} for row in result.rows]
        # The kernel the variant itself trains with (gatv2 and constant: torch), as the stage checks it.
        kernel = planned_kernel(setup.model, setup.optim, int(graph_tensors["num_classes"]), device)
        return dataclasses.replace(result, rows=rows, worker={**result.worker, "training_kernel": kernel})

    @contextlib.contextmanager
    def inline(executor: str, workers: int, device: torch.device,
               start_now: bool = True) -> Iterator[Callable[[], WorkerPool]]:
        yield InlinePool

    monkeypatch.setattr(seed_pool, "train_seeds", train)
    monkeypatch.setattr(ablation, "starting_pool", inline)
    return calls


def _run(monkeypatch: pytest.MonkeyPatch) -> int:
    return run_stage_in_process(monkeypatch, "stages.ablation", ablation.run, *ARGS)


def _runs() -> list:
    experiment = MlflowClient().get_experiment_by_name(ABLATION_EXPERIMENT)
    return [] if experiment is None else MlflowClient().search_runs([experiment.experiment_id], max_results=1000)


def test_every_variant_is_reported_drawn_cached_and_logged_in_groups(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, trained: list, capsys: pytest.CaptureFixture[str]) -> None:
    set_params(workdir, **{"ablation.variants": ["gat", "gatv2", "constant"]})
    assert _run(monkeypatch) == 0
    out = capsys.readouterr().out
    assert sorted(trained) == [(v, [s]) for v in ("constant", "gat", "gatv2") for s in (0, 1)]

    report = (workdir / "reports/ablation.md").read_text()
    assert "paired by seed" in report and "python -m stages.ablation --data data/prepared" in report
    rows = [line for line in report.splitlines() if line.startswith("| cora |")]
    assert [row.split(" | ")[1] for row in rows] == ["gat", "gatv2", "constant"]
    assert "| baseline |" in rows[0]
    # Seed by seed the shift is exact, so the differences have no spread: the interval is the point.
    assert "| +0.40 points | [+0.40, +0.40] points | 2 / 0 / 0 |" in rows[1]
    assert "| -1.00 points | [-1.00, -1.00] points | 0 / 2 / 0 |" in rows[2]
    assert (workdir / "reports/ablation.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "compare-runs?runs=" in out and "http://127.0.0.1:5000/#/experiments/" in out

    for variant in VARIANT_SHIFT:
        cache = workdir / "data/ablation/cora" / variant
        assert (cache / "seeds.csv").read_text().count("\n") == 3  # a header and 2 seeds
        assert json.loads((cache / "fingerprint.json").read_text())["setup"]["model"]["attention"] == variant

    runs = _runs()
    assert {run.info.status for run in runs} == {"FINISHED"}
    by_level: dict[str, list] = {}
    for run in runs:
        by_level.setdefault(run.data.tags[ABLATION_LEVEL], []).append(run)
    (invocation,) = by_level["invocation"]
    cells = {run.data.tags["variant"]: run for run in by_level["cell"]}
    assert set(cells) == set(VARIANT_SHIFT)
    for variant, cell in cells.items():
        assert cell.data.tags["mlflow.parentRunId"] == invocation.info.run_id
        assert cell.data.tags["dataset"] == "cora" and cell.data.tags["training_kernel"]
        assert cell.data.params["model.attention"] == variant
        assert cell.data.metrics["seeds"] == 2
    assert cells["constant"].data.metrics["diff_to_gat_mean"] == pytest.approx(-0.01)
    assert cells["constant"].data.metrics["seeds_worse_than_gat"] == 2
    assert "diff_to_gat_mean" not in cells["gat"].data.metrics
    seeds = by_level["seed"]
    assert sorted((run.data.tags["variant"], run.data.params["seed"]) for run in seeds) == sorted(
        (v, s) for v in VARIANT_SHIFT for s in ("0", "1"))
    assert all(run.data.tags["mlflow.parentRunId"] == cells[run.data.tags["variant"]].info.run_id for run in seeds)
    artifacts = {item.path for item in MlflowClient().list_artifacts(invocation.info.run_id)}
    assert {"ablation.md", "ablation.png", "ablation.json"} <= artifacts


def test_a_second_run_trains_nothing_and_a_new_variant_only_its_cell(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, trained: list) -> None:
    assert _run(monkeypatch) == 0
    assert trained == [("gat", [0]), ("gat", [1])]
    first = (workdir / "reports/ablation.md").read_text()
    assert "every seed trained by it" in first

    assert _run(monkeypatch) == 0
    assert len(trained) == 2  # nothing more trained
    again = (workdir / "reports/ablation.md").read_text()
    assert "0 of 2 seeds trained by it, the others from the cache" in again
    assert [line for line in again.splitlines() if line.startswith("| cora")] == [
        line for line in first.splitlines() if line.startswith("| cora")]  # worker time: the cached seeds' own

    set_params(workdir, **{"ablation.variants": ["gat", "constant"], "ablation.seeds": 3})
    assert _run(monkeypatch) == 0
    assert trained[2:] == [("gat", [2]), ("constant", [0]), ("constant", [1]), ("constant", [2])]

    set_params(workdir, **{"reproduce.protocol.cora.optim.max_epochs": 16})  # a setup changed: every cell again
    assert _run(monkeypatch) == 0
    assert sorted(trained[6:]) == sorted((v, [s]) for v in ("gat", "constant") for s in (0, 1, 2))
    assert all(run.info.status == "FINISHED" for run in _runs())


def test_the_real_variants_train_and_name_their_kernels(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No short-circuit: each variant's own layers, in this process; gatv2 and constant train with torch."""
    set_params(workdir, **{"ablation.variants": ["gat", "gatv2", "constant"],
                           "reproduce.protocol.cora.optim.max_epochs": 4})

    @contextlib.contextmanager
    def inline(executor: str, workers: int, device: torch.device,
               start_now: bool = True) -> Iterator[Callable[[], WorkerPool]]:
        yield InlinePool

    monkeypatch.setattr(ablation, "starting_pool", inline)
    assert _run(monkeypatch) == 0
    cells = {run.data.tags["variant"]: run for run in _runs() if run.data.tags[ABLATION_LEVEL] == "cell"}
    assert cells["gat"].data.tags["training_kernel"] == planned_kernel(
        *_cora_setup(workdir), torch.device("cpu"))
    for variant in ("gatv2", "constant"):
        assert cells[variant].data.tags["training_kernel"].startswith("torch")
    weights = {variant: (workdir / "data/ablation/cora" / variant / "seeds.csv").read_text() for variant in cells}
    assert len(set(weights.values())) == 3  # three different models, not one trained three times


def _cora_setup(workdir: Path) -> tuple[Any, Any, int]:
    from stages.support.params import load_params

    setup = load_params(workdir / "params.yaml").reproduce.protocol["cora"]
    return setup.model, setup.optim, 7


def test_a_missing_prepared_dataset_is_one_line_and_nothing_is_written(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, trained: list, capsys: pytest.CaptureFixture[str]) -> None:
    set_params(workdir, **{"ablation.datasets": ["cora", "citeseer"]})
    assert _run(monkeypatch) == 2
    err = capsys.readouterr().err
    assert err == ("error: data/prepared/citeseer is missing: it is made by the `preprocess@citeseer` stage. Run "
                   "`dvc repro preprocess@citeseer` first.\n")
    assert not trained and not (workdir / "reports").exists() and not (workdir / "data/ablation").exists()
    assert not (workdir / "mlflow.db").exists() or not _runs()


def test_a_variant_this_checkout_cannot_build_is_refused_before_any_work(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def unbuilt(config: Any, *args: Any) -> None:
        raise ValueError(f"model.attention {config.attention!r} is not implemented yet")

    monkeypatch.setattr(ablation, "GAT", unbuilt)
    set_params(workdir, **{"ablation.variants": ["gat", "gatv2"]})
    assert _run(monkeypatch) == 2
    assert capsys.readouterr().err == (
        "error: `ablation.variants`: 'gat' can't be trained by this checkout (model.attention 'gat' is not "
        "implemented yet); drop it from the list, or update the checkout.\n")
    assert not (workdir / "reports").exists() and not (workdir / "data/ablation").exists()


def test_sigterm_while_training_leaves_no_running_run_and_no_output(workdir: Path) -> None:
    """The real command, with its worker processes, stopped while its seeds train (they would not stop by
    themselves): exit 143, every run FAILED, no report, no picture and no cell in the cache."""
    set_params(workdir, **{"reproduce.protocol.cora.optim.max_epochs": 100000,
                           "reproduce.protocol.cora.optim.patience": 100000, "reproduce.workers": 1})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    err = workdir / "stderr.txt"
    with err.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "stages.ablation", *ARGS], cwd=workdir, env=env,
                                   stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        # The worker names itself once it has started (stages.support.local_pool.WORKER_NAME): the batches are its.
        while not any(child.name() == WORKER_NAME for child in psutil.Process(process.pid).children()):
            assert process.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        time.sleep(2)  # the worker is training
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM, err.read_text()
    assert "error: interrupted by SIGTERM" in err.read_text()
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    assert {run.info.status for run in _runs()} == {"FAILED"}
    assert not (workdir / "reports").exists()
    assert not (workdir / "data/ablation").exists() or not any(path.is_file() for path in
                                                              (workdir / "data/ablation").rglob("*"))
