"""A dataset's whole `reproduce` stage in this checkout against an earlier commit's, taking turns.

    python -m benchmarks.stage_ab --against 1074697 --data data/prepared/cora     # issue 22's starting point
    python -m benchmarks.stage_ab --against 1074697 --raw ../shared/datasets/planetoid
    python -m benchmarks.stage_ab --against 9a20b0a --data data/prepared/cora --team  # both against a team server

Issue 22 counts its throughput in seed-epochs per CPU second of `reproduce`. `make bench` (benchmarks.train_ab) times
the training loop alone; this times the stage itself: each side's own `python -m stages.reproduce`, with its own
params.yaml, code and kernel (the older commit's tree from `git archive`, its kernel built aside), on the same
prepared data: `--data`, a preprocess output folder (`make repro` writes data/prepared/cora), or else the raw
Planetoid files in `--raw` (by default the machines' shared copy, else data/raw/cora), which this checkout's own
preprocess stage prepares first, untimed, into the temporary folder. Each run tracks into its own SQLite store in a
temporary folder and writes its outputs there; nothing is written in the repository. With `--team`, every run
tracks into one team backend instead (team.backend.temporary_backend: PostgreSQL, SeaweedFS and `mlflow server`,
as `make team-up` starts them, in the temporary folder, on this machine, stopped at the end). `make bench` runs it
once for Cora against issue 22's starting point (benchmarks.throughput.stage_against_issue_22_start).

A run's CPU time is its whole process tree's, the worker processes included (getrusage of the waited children), and
its seed-epochs are the `epochs` column of the seeds.csv it writes. Both sides must write the same seeds.csv. The
sides take turns `--rounds` times, the order swapping each round. Prints each side's seed-epochs per CPU second and
wall time, median [min-max], and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from benchmarks.data import default_data_dir
from benchmarks.kernel_ab import REPO_ROOT, turns
from benchmarks.train_ab import build_older_kernel, die_with_this_process, side_environment, unpack_revision
from gat import fused
from stages.support import interrupts
from stages.support.params import StageError


def children_cpu_s() -> float:
    """User and system CPU seconds of every waited child process so far (and of the children they waited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def failure(ran: subprocess.CompletedProcess, what: str) -> StageError:
    lines = (ran.stderr or ran.stdout or "").strip().splitlines() or ["?"]
    return StageError(f"{what} failed: {lines[-1].removeprefix('error: ')}")  # the stages' one line, once


def tracked_environment(fused_dir: Path | None, store: Path | Mapping[str, str]) -> dict[str, str]:
    """The user's thread settings, as `dvc repro` would run a stage, with the kernel in `fused_dir` (None: this
    checkout's), tracking into the SQLite store `store` of the run's own, or the server these client settings name."""
    tracking = store if isinstance(store, Mapping) else {"MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    return {**side_environment(fused_dir, one_thread=False), **tracking}


def run_module(arguments: list[str], tree: Path, env: dict[str, str], what: str) -> None:
    """`python -m ARGUMENTS` in `tree`; StageError(`what` failed: its last line) if it fails."""
    ran = subprocess.run([sys.executable, "-m", *arguments], cwd=tree, env=env, capture_output=True, text=True,
                         preexec_fn=die_with_this_process)
    if ran.returncode != 0:
        raise failure(ran, what)


def prepare(raw: Path, dataset: str, folder: Path) -> Path:
    """`dataset` prepared from the raw files in `raw` by this checkout's preprocess stage, tracking into its own store
    in `folder`: `folder`/prepared, what `make repro` writes to data/prepared/`dataset`."""
    env, prepared = tracked_environment(None, folder / "prepare.db"), folder / "prepared"
    what = f"preparing {dataset} from {raw}"
    run_module(["tools.init_store"], REPO_ROOT, env, what)
    run_module(["stages.preprocess", "--dataset", dataset, "--raw", str(raw.resolve()), "--out", str(prepared)],
               REPO_ROOT, env, what)
    return prepared


def run_stage(tree: Path, fused_dir: Path | None, dataset: str, data: Path, folder: Path,
              server: Mapping[str, str] | None = None) -> dict:
    """One run of `tree`'s reproduce stage on `data`, tracking into the `server` that these client settings name, or
    else into `folder`/mlflow.db (created first, untimed), and writing to `folder`/out: its wall and CPU seconds, its
    seed-epochs and its seeds.csv's SHA-256."""
    env = tracked_environment(fused_dir, folder / "mlflow.db" if server is None else server)
    if server is None:
        run_module(["tools.init_store"], tree, env, f"creating the MLflow store in {folder}")
    out = folder / "out"
    cpu, start = children_cpu_s(), time.perf_counter()
    run_module(["stages.reproduce", "--dataset", dataset, "--data", str(data), "--out", str(out)], tree, env,
               f"the reproduce stage in {tree}")
    wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu
    seeds = (out / "seeds.csv").read_bytes()
    epochs = sum(int(row["epochs"]) for row in csv.DictReader(seeds.decode().splitlines()))
    return {"wall_s": wall, "cpu_s": cpu, "seed_epochs": epochs, "seeds_csv_sha256": hashlib.sha256(seeds).hexdigest()}


def take_turns(sides: dict[str, tuple[Path, Path | None]], dataset: str, data: Path, rounds: int,
               folder: Path, server: Mapping[str, str] | None = None) -> dict[str, list[dict]]:
    """`rounds` runs of each side (name: (tree, kernel folder)), the order swapping every round; each tracking into
    `server` (run_stage), or its own SQLite store."""
    samples: dict[str, list[dict]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for index, name in enumerate(turns(list(sides), round_)):
            run_folder = folder / f"round{round_}-side{index}"
            run_folder.mkdir()
            samples[name].append(run_stage(*sides[name], dataset, data, run_folder, server))
    return samples


def comparison(samples: dict[str, list[dict]]) -> dict:
    """Each side's seed-epochs per CPU second and wall seconds (samples and medians), the ratio of the first side's
    median rate to the second's, and whether every run wrote the same seeds.csv."""
    rates = {name: [run["seed_epochs"] / run["cpu_s"] for run in runs] for name, runs in samples.items()}
    walls = {name: [run["wall_s"] for run in runs] for name, runs in samples.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    this, older = list(samples)
    return {"clock": "CPU time of the stage's process tree", "seed_epochs_per_s_samples": rates,
            "seed_epochs_per_s": medians, "wall_s_samples": walls, "speedup": medians[this] / medians[older],
            "seed_epochs": sorted({run["seed_epochs"] for runs in samples.values() for run in runs}),
            "same_seeds": len({run["seeds_csv_sha256"] for runs in samples.values() for run in runs}) == 1}


def summary(compared: dict) -> list[str]:
    """Lines: each side's rate and wall time, median [min-max], the ratio, and whether the seeds.csv files agree."""
    lines = []
    for name, rates in compared["seed_epochs_per_s_samples"].items():
        walls = compared["wall_s_samples"][name]
        wall = f"{statistics.median(walls):.1f} [{min(walls):.1f}-{max(walls):.1f}] s"
        lines.append(f"{name}: {compared['seed_epochs_per_s'][name]:.0f} [{min(rates):.0f}-{max(rates):.0f}] "
                     f"seed-epochs per CPU second, {wall} of wall time")
    this, older = list(compared["seed_epochs_per_s"])
    lines.append(f"{this} / {older} = {compared['speedup']:.3f}")
    lines.append(f"the same seeds.csv in every run ({', '.join(map(str, compared['seed_epochs']))} seed-epochs)"
                 if compared["same_seeds"] else "the seeds.csv files differ between runs")
    return lines


def against_revision(revision: str, dataset: str, data: Path | None, rounds: int, raw: Path | None = None,
                     team: bool = False) -> dict:
    """This checkout's stage against `revision`'s (comparison), on the prepared `data`, or else on `dataset` prepared
    first (untimed) from the raw files in `raw` (by default benchmarks.data.default_data_dir()'s); with `team`, both
    tracking into one team backend started for the purpose."""
    reason = fused.unavailable_reason()
    if reason is not None:
        raise StageError(f"this checkout's fused kernel is unavailable ({reason}): build it with `make .venv/.fused`")
    with tempfile.TemporaryDirectory(prefix="gat-stage-ab-") as name, contextlib.ExitStack() as backend:
        folder = Path(name)
        if data is None:
            data = prepare(raw or default_data_dir(), dataset, folder)
        tree = unpack_revision(revision, folder)
        sides = {"this checkout": (REPO_ROOT, None), revision: (tree, build_older_kernel(tree, revision))}
        server = None
        if team:
            from team.backend import temporary_backend

            server = backend.enter_context(temporary_backend(folder / "team"))
        compared = comparison(take_turns(sides, dataset, data.resolve(), rounds, folder, server))
    return {"against": revision, "dataset": dataset, "rounds": rounds, "store": "team" if team else "sqlite",
            **compared}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit whose reproduce stage to compare with")
    inputs = parser.add_mutually_exclusive_group()
    inputs.add_argument("--data", type=Path, help="a preprocess output folder (data/prepared/cora)")
    inputs.add_argument("--raw", type=Path, help="a folder of the raw Planetoid files, prepared first (default: the "
                                                 "machines' shared copy, else data/raw/cora)")
    parser.add_argument("--dataset", default="cora", help="the dataset's name in params.yaml (default: cora)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, taking turns")
    parser.add_argument("--team", action="store_true", help="track into a team backend started for the purpose "
                                                             "(as `make team-up`), not into SQLite stores")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.rounds < 1:
            raise StageError(f"--rounds must be at least 1, not {args.rounds}")
        if args.data is not None and not (args.data / "graph.pt").is_file():
            raise StageError(f"{args.data} is not a prepared dataset (no graph.pt): run `make repro` first, or pass "
                             "the preprocess stage's output folder")
        if args.raw is not None and not args.raw.is_dir():
            raise StageError(f"{args.raw} is not a folder: pass the folder of the raw Planetoid files "
                             "(ind.cora.x, ...)")
        compared = against_revision(args.against, args.dataset, args.data, args.rounds, args.raw, args.team)
        print("\n".join(summary(compared)))

    # SIGTERM, Ctrl-C or a dead parent: one line, the running stage killed, the temporary folder removed.
    interrupts.main(run, stopping="stopping; the running stage is killed and the temporary folder removed.")


if __name__ == "__main__":
    main()
