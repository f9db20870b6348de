"""benchmarks.stage_timeline: a reproduce run's timeline from its parent and child runs, on made-up times and on a
real SQLite store written the way the stage writes it (stages.support.tracking.log_child_runs)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks import stage_timeline
from benchmarks.stage_timeline import SeedSpan, timeline


def test_batches_are_the_seeds_a_worker_started_together_and_idle_is_the_wait_for_the_last_one() -> None:
    t0 = 1000.0
    seeds = [SeedSpan("a", t0 + 1, t0 + 4, 300), SeedSpan("a", t0 + 1, t0 + 5, 400),  # a batch of 2, 4 s
             SeedSpan("a", t0 + 5, t0 + 7, 200),                                        # then a batch of 1, 2 s
             SeedSpan("b", t0 + 2, t0 + 10, 800)]                                       # b: one batch, 8 s
    t = timeline(t0, t0 + 12, seeds)
    assert (t.parent_s, t.first_start, t.last_end, t.after_training) == (12, 1, 10, 2)
    a, b = t.workers
    assert (a.worker, a.batches, a.seeds, a.seed_epochs, a.start, a.end, a.idle_at_end) == ("a", 2, 3, 900, 1, 7, 3)
    assert (b.worker, b.batches, b.seeds, b.seed_epochs, b.start, b.end, b.idle_at_end) == ("b", 1, 1, 800, 2, 10, 0)
    assert (t.seed_epochs, t.batch_seconds) == (1700, 14)
    assert t.ms_per_seed_epoch == pytest.approx(1000 * 14 / 1700)


def test_no_child_runs_is_an_error() -> None:
    with pytest.raises(ValueError, match="no child runs"):
        timeline(0.0, 1.0, [])


def test_reads_the_latest_reproduce_run_of_a_dataset_from_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from mlflow.tracking import MlflowClient

    from stages.support.store import REPRODUCE_EXPERIMENT, connect
    from stages.support.tracking import log_child_runs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = connect(REPRODUCE_EXPERIMENT)
    client = MlflowClient()
    start = time.time() - 100
    for name, epochs in (("older", 1), ("newer", 100)):
        parent = client.create_run(experiment_id, start_time=int(1000 * start), run_name=name,
                                   tags={"dataset": "cora"})
        rows = [{"seed": seed, "test_acc": 0.8, "epochs": epochs + seed} for seed in range(3)]
        timings = {0: (start + 1, start + 5), 1: (start + 1, start + 6), 2: (start + 2, start + 9)}
        workers = {0: {"worker_host": "h", "worker_pid": "1"}, 1: {"worker_host": "h", "worker_pid": "1"},
                   2: {"worker_host": "h", "worker_pid": "2"}}
        log_child_runs(parent.info.run_id, experiment_id, "cora", rows, timings, {"dataset": "cora"}, workers)
        client.set_terminated(parent.info.run_id, "FINISHED", end_time=int(1000 * (start + 10)))
        start += 20
    stage_timeline.main(["--dataset", "cora"])
    out = capsys.readouterr().out
    assert "(newer), 3 seeds" in out
    assert "parent run: 10.00 s; the first batch started 1.00 s in, the last seed ended at 9.00 s" in out
    assert "h (pid 1): 1 batches, 2 seeds, 201 seed-epochs, 1.00 to 6.00 s, then 3.00 s waiting" in out
    assert "h (pid 2): 1 batches, 1 seeds, 102 seed-epochs, 2.00 to 9.00 s, then 0.00 s waiting" in out
    assert f"{1000 * 12 / 303:.3f} ms of a worker's wall time per seed-epoch" in out


def test_a_store_without_the_datasets_runs_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(SystemExit) as stopped:
        stage_timeline.main(["--dataset", "citeseer"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: no finished reproduce run of 'citeseer' in this MLflow store: run `dvc repro` "
                   "(or python -m stages.reproduce) first, or pass --run"]
