"""Time `reproduce@cora` on each executor, in the same run, and estimate an ablation's wall time from it.

    python -m benchmarks.scale --seeds 100 --out reports/scale.json

Runs the real stage (`python -m stages.reproduce`) as a user's `dvc repro` would, in a scratch workspace
(the repository's params.yaml with `reproduce.seeds` set, Cora prepared by the preprocess stage, a
throwaway MLflow store), once per setting and round, the settings taking turns:

- `local`: the default executor, worker processes on this machine (`workers` 2);
- `dask-2`: `executor: dask` without a scheduler, i.e. a LocalCluster of 2 single-threaded workers;
- `dask-1`: the same with 1 worker.

Each time is the stage's whole wall time: start-up, the cluster's start and stop, training, evaluation and
the MLflow logging of the parent and every seed's child run. The report gives the Dask overhead
(`dask-2` against `local`, the issue's bound is 10%), the speed-up from 1 to 2 workers, and checks that
every setting wrote the same seeds.csv.

From the 1- and 2-worker times, T(W) = F + C / W gives a stage's fixed cost F (start-up, logging, the
cluster) and its compute C (worker-seconds). On paper, an ablation of `--configs` configurations x
`--seeds` seeds x `--datasets` datasets is that many stage runs, E; on W workers, J of them run at once
(`dvc queue start -j J`, J <= 8 chosen to finish first), each with W / J workers:

    wall(W) = ceil(E / J) x (F + ceil(B / (W / J)) x C / B),     B = batches per stage

The estimate assumes a Citeseer seed costs what a Cora seed does (the 100-seed runs in
reports/fused-kernel-log.md: 5 % more) and that workers on other hosts are as fast as these; F includes
starting a LocalCluster, which a shared cluster doesn't pay, so it errs on the long side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from benchmarks.data import DATASET, REPO_ROOT, default_data_dir

# name -> (executor, workers) of each timed setting; they take turns within a round.
SETTINGS = {"local": ("local", 2), "dask-2": ("dask", 2), "dask-1": ("dask", 1)}
WORKER_COUNTS = (1, 8, 64)
OVERHEAD_BOUND = 0.10
# At most this many experiments at once (`dvc queue start -j`): each is a stage process on the driving host.
MAX_PARALLEL = 8


def _environment(root: Path) -> dict[str, str]:
    """The stage's environment: the project as installed (`make`: this checkout, in editable mode; no PYTHONPATH),
    a throwaway store, no Dask scheduler, no dashboard."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "DASK_"))}
    return env | {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
                  "MLFLOW_DISABLE_TELEMETRY": "true", "GAT_DASK_DASHBOARD": "off",
                  "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}


def _run(command: Sequence[str], root: Path, env: dict[str, str]) -> float:
    """Run a stage; its wall time in seconds. A failure stops the benchmark with the stage's own message."""
    started = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"error: `{' '.join(command)}` exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return elapsed


def set_params(root: Path, **dotted: Any) -> None:
    """Set params.yaml's values at `root` by dotted key (`train.optim.lr=0.01`), everything else as it was."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        section = params
        for name in parents:
            section = section[name]
        section[leaf] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def prepare(root: Path, data_dir: Path, seeds: int) -> dict[str, str]:
    """A scratch workspace with the repository's params (`seeds` seeds) and Cora prepared by its stage."""
    shutil.copy(REPO_ROOT / "params.yaml", root / "params.yaml")
    set_params(root, **{"reproduce.seeds": seeds, "reproduce.first_seed": 0})
    env = _environment(root)
    python = sys.executable
    _run([python, "-m", "tools.init_store"], root, env)
    _run([python, "-m", "stages.preprocess", "--dataset", DATASET, "--raw", str(data_dir), "--out",
          f"data/prepared/{DATASET}"], root, env)
    return env


def fit(t1: float, t2: float) -> tuple[float, float]:
    """(F, C) of T(W) = F + C / W through the 1- and 2-worker times; F is at least 0."""
    compute = 2.0 * (t1 - t2)
    fixed = max(0.0, 2.0 * t2 - t1)
    return fixed, max(compute, 0.0)


def ablation_wall_s(fixed_s: float, compute_s: float, batches: int, stage_runs: int, workers: int,
                    max_parallel: int = MAX_PARALLEL) -> tuple[float, int]:
    """(the estimated wall time, the experiments run at once) of `stage_runs` stages on `workers` workers.

    Each stage costs `fixed_s` plus its `batches` batches of `compute_s / batches` worker-seconds each, spread
    over its share of the workers; the number run at once is the one (up to `max_parallel`) that finishes first.
    """
    per_batch = compute_s / batches
    best: tuple[float, int] | None = None
    for parallel in range(1, min(max_parallel, stage_runs) + 1):
        share = workers / parallel
        rounds = math.ceil(batches / share) if share >= 1 else batches / share
        wall = math.ceil(stage_runs / parallel) * (fixed_s + rounds * per_batch)
        if best is None or wall < best[0]:
            best = (wall, parallel)
    assert best is not None
    return best


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _hms(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min" if seconds >= 3600 else \
        f"{seconds // 60} min {seconds % 60:02d} s"


def measure(args: argparse.Namespace) -> dict:
    from stages.support.seed_task import worker_facts

    data_dir = args.data_dir or default_data_dir()
    with tempfile.TemporaryDirectory(prefix="gat-scale-") as scratch:
        root = Path(scratch)
        env = prepare(root, data_dir, args.seeds)
        spb = yaml.safe_load((root / "params.yaml").read_text())["reproduce"]["seeds_per_batch"]
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        outputs: dict[str, bytes] = {}
        for round_ in range(args.rounds):
            for name, (executor, workers) in SETTINGS.items():
                set_params(root, **{"reproduce.executor": executor, "reproduce.workers": workers})
                out = root / "out" / f"{name}-{round_}"
                elapsed = _run([sys.executable, "-m", "stages.reproduce", "--dataset", DATASET, "--data",
                                f"data/prepared/{DATASET}", "--out", str(out)], root, env)
                times[name].append(elapsed)
                outputs[f"{name}-{round_}"] = (out / "seeds.csv").read_bytes()
                print(f"{name} round {round_ + 1}: {elapsed:.1f} s", file=sys.stderr, flush=True)
    medians = {name: _median(values) for name, values in times.items()}
    overhead = medians["dask-2"] / medians["local"] - 1.0
    speedup = medians["dask-1"] / medians["dask-2"]
    fixed, compute = fit(medians["dask-1"], medians["dask-2"])
    batches = math.ceil(args.seeds / spb)
    stage_runs = args.configs * args.datasets
    estimates = {}
    for workers in WORKER_COUNTS:
        wall, parallel = ablation_wall_s(fixed, compute, batches, stage_runs, workers)
        estimates[str(workers)] = {"wall_s": wall, "wall": _hms(wall), "experiments_at_once": parallel}
    return {
        "dataset": DATASET, "seeds": args.seeds, "seeds_per_batch": spb, "rounds": args.rounds,
        "seconds": times, "median_s": medians,
        "dask_overhead_vs_local": overhead, "dask_overhead_bound": OVERHEAD_BOUND,
        "dask_overhead_within_bound": bool(overhead <= OVERHEAD_BOUND),
        "speedup_1_to_2_workers": speedup,
        "seeds_csv_identical": len(set(outputs.values())) == 1,
        "model": {"fixed_s": fixed, "compute_worker_s": compute, "per_seed_worker_s": compute / args.seeds,
                  "batches_per_stage": batches},
        "ablation": {"configs": args.configs, "seeds": args.seeds, "datasets": args.datasets,
                     "stage_runs": stage_runs, "by_workers": estimates},
        "machine": {"cpu_model": worker_facts()["cpu_model"], "logical_cores": os.cpu_count(),
                    "python": platform.python_version()},
    }


def format_report(report: dict) -> str:
    medians, ablation, model = report["median_s"], report["ablation"], report["model"]
    lines = [f"reproduce@{report['dataset']}, {report['seeds']} seeds, {report['seeds_per_batch']} per batch "
             f"(median of {report['rounds']} round(s)):",
             *(f"  {name:7s} {medians[name]:8.1f} s" for name in SETTINGS),
             f"  Dask overhead (dask-2 / local - 1): {100 * report['dask_overhead_vs_local']:+.1f} % "
             f"(bound {100 * report['dask_overhead_bound']:.0f} %)",
             f"  speed-up from 1 to 2 workers: {report['speedup_1_to_2_workers']:.2f}x",
             f"  seeds.csv identical in every run: {'yes' if report['seeds_csv_identical'] else 'NO'}",
             f"  per stage: fixed {model['fixed_s']:.1f} s, compute {model['compute_worker_s']:.1f} worker-s "
             f"({model['per_seed_worker_s']:.2f} per seed)",
             f"ablation of {ablation['configs']} configurations x {ablation['seeds']} seeds x {ablation['datasets']} "
             f"datasets ({ablation['stage_runs']} stage runs), on paper:"]
    if not model["compute_worker_s"]:
        lines.append("  not measurable: 2 workers were no faster than 1 (fixed costs dominate, or the machine is "
                     "busy); time more seeds on a quiet machine")
        return "\n".join(lines)
    for workers, estimate in ablation["by_workers"].items():
        lines.append(f"  {workers:>3s} workers: {estimate['wall']:>14s} ({estimate['experiments_at_once']} "
                     "experiments at once)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100, help="seeds per timed run (the paper's 100)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the three settings, taking turns")
    parser.add_argument("--configs", type=int, default=50, help="configurations of the estimated ablation")
    parser.add_argument("--datasets", type=int, default=2, help="datasets of the estimated ablation")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder with the raw ind.cora.* files (default: as benchmarks.data finds them)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.seeds < 2 or args.rounds < 1 or args.configs < 1 or args.datasets < 1:
        parser.error("--seeds must be at least 2, and --rounds, --configs, --datasets at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from stages.support.params import StageError

    args = parse_args(argv)
    try:
        report = measure(args)
    except StageError as error:
        raise SystemExit(f"error: {error}") from None
    print(format_report(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
