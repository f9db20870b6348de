"""Time logging reproduce@cora's child runs: the SQLite store against a team server, in one run.

    python -m benchmarks.child_runs --out reports/benchmark-team.json      (what `make bench-team` runs)

The reproduce stage logs one child run per seed, each batch's as it comes in, with
stages.support.tracking.log_child_runs (a create, a batch of params, metrics and tags, and a terminate per seed).
This times exactly that call for `--seeds` children (100, as reproduce@cora), `--repeats` times, against

- `sqlite`: a fresh SQLite store in a temporary folder, as `make repro` on a laptop;
- `server`: a team backend started for the benchmark (team.backend.up, as `make team-up`, in a temporary
  state folder, stopped at the end): `mlflow server` with basic-auth on PostgreSQL, over loopback HTTP.

Each repetition logs under a new parent run; the stores are created before the clock starts. The
report gives each store's median and range, and the ratio server / SQLite of the medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]


def _rows(seeds: int) -> tuple[list[dict], dict[int, tuple[float, float]]]:
    """Rows shaped like reproduce's (the values do not matter to the store), and their training times."""
    now = time.time()
    rows = [{"seed": seed, "test_acc": 0.8 + seed / 1000, "val_acc": 0.79, "epochs": 300 + seed, "best_epoch": 200}
            for seed in range(seeds)]
    return rows, {seed: (now - 30, now - 10) for seed in range(seeds)}


def time_child_logging(seeds: int, repeats: int) -> list[float]:
    """Seconds per `log_child_runs` of `seeds` children, against the store MLFLOW_TRACKING_URI names."""
    from mlflow.tracking import MlflowClient

    from stages.support.store import REPRODUCE_EXPERIMENT, connect
    from stages.support.tracking import log_child_runs

    experiment_id = connect(REPRODUCE_EXPERIMENT)
    client = MlflowClient()
    rows, timings = _rows(seeds)
    seconds = []
    for repeat in range(repeats):
        parent = client.create_run(experiment_id, run_name=f"bench-parent-{repeat}")
        started = time.perf_counter()
        log_child_runs(parent.info.run_id, experiment_id, "cora", rows, timings, {"dataset": "cora"})
        seconds.append(time.perf_counter() - started)
        client.set_terminated(parent.info.run_id, "FINISHED")
    return seconds


def _summary(seconds: list[float]) -> dict:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "runs_s": seconds}


def run(seeds: int, repeats: int) -> dict:
    from team.backend import temporary_backend

    with tempfile.TemporaryDirectory(prefix="gat-bench-") as folder:
        root = Path(folder)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'sqlite' / 'mlflow.db'}"
        (root / "sqlite").mkdir()
        sqlite = time_child_logging(seeds, repeats)
        with temporary_backend(root / "team") as client_env:
            os.environ.update(client_env)
            server = time_child_logging(seeds, repeats)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version()}
    return {"children": seeds, "repeats": repeats, "machine": machine,
            "sqlite": _summary(sqlite), "server": _summary(server),
            "server_over_sqlite": statistics.median(server) / statistics.median(sqlite)}


def main(argv: Sequence[str] | None = None) -> None:
    from stages.support.files import write_json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.child_runs", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "benchmark-team.json")
    parser.add_argument("--seeds", type=int, default=100, help="child runs per repetition (reproduce@cora: 100)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    report = run(args.seeds, args.repeats)
    write_json(args.out, report)
    for store in ("sqlite", "server"):
        s = report[store]
        print(f"{store:7} {args.seeds} child runs: median {s['median_s']:.2f} s "
              f"(range {s['min_s']:.2f}-{s['max_s']:.2f} s over {args.repeats})")
    print(f"server / SQLite: {report['server_over_sqlite']:.2f}x  -> {args.out}")


if __name__ == "__main__":
    main()
