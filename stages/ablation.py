"""Does attention matter? Every attention variant on the same seeds of each dataset, compared with the paper's.

    python -m stages.ablation [--data data/prepared] [--cache data/ablation] [--report reports/ablation.md]
                              [--plot reports/ablation.png]           (make ablation)

Not a DVC stage (it takes tens of minutes, and `make repro` must not): it reads the preprocessed datasets that
`make repro` made. For each dataset of `ablation.datasets` and variant of `ablation.variants` (a cell), it trains
`ablation.seeds` seeds with the dataset's `reproduce.protocol` block, `model.attention` replaced, as the reproduce
stage trains them (its executor, workers and batches: stages.support.seed_pool). Then it writes

- `reports/ablation.md`: per dataset and variant, the test accuracy's mean ± std and 95% CI, and the difference
  to `gat` paired by seed (a t interval of the per-seed differences) with how many seeds the variant beat `gat`
  on; the command, the machine, the commit, the date and the wall time that made it;
- `reports/ablation.png`: the same, drawn.

Each cell's per-seed results are cached in `<cache>/<dataset>/<variant>/seeds.csv` beside `fingerprint.json`
(the dataset's files, the cell's setup, the training code and kernel): a cell whose fingerprint matches
trains only the seeds it lacks, so an interrupted or repeated run only trains what is missing or changed.
MLflow's `gat-repro-ablation` experiment gets one run per invocation (the report and picture), under it one
per cell (its summary), under each one per seed.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import mlflow
import torch

from gat.config import BASELINE_ATTENTION, Setup, flatten
from gat.data import Graph, graph_to_tensors
from gat.fused import cpu_identity
from gat.model import GAT
from gat.reproduction import PairedDifference, Summary, paired_difference, summarise
from gat.seeds import BatchResult
from gat.training import planned_kernel
from stages.support.figures import png_bytes
from stages.support.files import load_prepared, outputs_together, write_atomic, write_csv, write_json
from stages.support.interrupts import main
from stages.support.local_pool import WorkerPool
from stages.support.params import ArgumentParser, device_for, fail, load_params, repo_root
from stages.support.progress import Progress, elapsed
from stages.support.seed_pool import check_same_code, gather, starting_pool
from stages.support.seed_task import code_sha256
from stages.support.store import (ABLATION_EXPERIMENT, ABLATION_LEVEL, NOTE, compare_url, is_server, shown_uri,
                                  tracking_uri, ui_url)
from stages.support.tables import pct
from stages.support.tracking import (data_digest, describe_run, git_commit, log_child_runs, logged_params, stage_run,
                                     standard_tags)

# A seed's results, as gat.seeds.train_seeds gives them (seeds.csv's first columns, and each seed run's metrics).
RESULT_COLUMNS = ("seed", "test_acc", "val_acc", "epochs", "best_epoch", "weights_sha256")
# Where and when it trained: the seed run's times and tags, kept in the cache so a cached seed logs them again.
WHERE_COLUMNS = ("started", "ended", "worker_host", "training_kernel")
TYPES = {"seed": int, "epochs": int, "best_epoch": int, "test_acc": float, "val_acc": float, "started": float,
         "ended": float}
# `make ui`'s address (tools.ui.DEFAULT_PORT): the pages to open once it runs.
LOCAL_UI = "http://127.0.0.1:5000"


@dataclass
class Cell:
    """One dataset and attention variant: its setup, its cache, and the seeds' rows found there or trained now."""

    dataset: str
    variant: str
    setup: Setup
    kernel: str  # gat.training.planned_kernel's name for it, here
    folder: Path
    fingerprint: dict[str, Any]
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # seed -> RESULT_COLUMNS + WHERE_COLUMNS
    trained: int = 0  # seeds trained by this invocation

    def values(self, seeds: Sequence[int], column: str) -> dict[int, float]:
        return {seed: self.rows[seed][column] for seed in seeds}


def variant_setup(setup: Setup, variant: str) -> Setup:
    """A dataset's protocol with its attention replaced."""
    return dataclasses.replace(setup, model=dataclasses.replace(setup.model, attention=variant))  # type: ignore[arg-type]


def fingerprint_of(dataset: str, checksums: dict[str, str], setup: Setup, kernel: str) -> dict[str, Any]:
    """What a cell's per-seed results depend on besides the seed, and its digest: equal digests, equal results."""
    facts = {"dataset": dataset, "data_sha256": data_digest(checksums), "setup": dataclasses.asdict(setup),
             "training_kernel": kernel, "code_sha256": code_sha256()}
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": digest, **facts}


def read_cache(folder: Path, fingerprint: str) -> tuple[dict[int, dict[str, Any]], str | None]:
    """The cached rows of a cell by seed, and why none are used (None: they are, or there are none)."""
    if not (folder / "fingerprint.json").is_file():
        return {}, None
    try:
        if json.loads((folder / "fingerprint.json").read_text())["fingerprint"] != fingerprint:
            return {}, "its setup, data, kernel or training code changed: trained again"
        with (folder / "seeds.csv").open(newline="") as file:
            rows = [{key: TYPES.get(key, str)(row[key]) for key in (*RESULT_COLUMNS, *WHERE_COLUMNS)}
                    for row in csv.DictReader(file)]
    except (OSError, ValueError, KeyError, TypeError) as error:  # damaged by hand: the cache is only a cache
        return {}, f"its cache is unreadable ({type(error).__name__}): trained again"
    return {row["seed"]: row for row in rows}, None


def write_cache(cell: Cell) -> None:
    """The cell's rows and fingerprint, renamed into place together (a stop waits the milliseconds it takes)."""
    with outputs_together():
        write_csv(cell.folder / "seeds.csv", [cell.rows[seed] for seed in sorted(cell.rows)])
        write_json(cell.folder / "fingerprint.json", cell.fingerprint)


def check_trainable(cell: Cell, graph: Graph) -> None:
    """Refuse, before any work, a variant that this checkout can't build."""
    try:
        GAT(cell.setup.model, graph.num_features, graph.num_classes, [0])
    except ValueError as error:
        fail(f"`ablation.variants`: {cell.variant!r} can't be trained by this checkout ({error}); drop it from "
             "the list, or update the checkout.")


def batches(seeds: Sequence[int], size: int) -> list[list[int]]:
    return [list(seeds[i:i + size]) for i in range(0, len(seeds), size)]


def record(cell: Cell, result: BatchResult) -> None:
    """A finished batch into its cell and the cell's cache."""
    check_same_code([result])  # nothing from other training code enters the cache
    for row in result.rows:
        started, ended = result.timings[row["seed"]]
        cell.rows[row["seed"]] = {**{key: row[key] for key in RESULT_COLUMNS}, "started": started, "ended": ended,
                                  "worker_host": result.worker["worker_host"],
                                  "training_kernel": result.worker["training_kernel"]}
    cell.trained += len(result.rows)
    write_cache(cell)


def record_job(work: Sequence[tuple[Cell, list[int]]], index: int, result: BatchResult) -> None:
    record(work[index][0], result)


def worker_seconds(cell: Cell, seeds: Sequence[int]) -> float:
    """The time the cell's batches took, summed: the seeds of one batch share its start."""
    ends: dict[float, float] = {}
    for seed in seeds:
        row = cell.rows[seed]
        ends[row["started"]] = max(ends.get(row["started"], row["started"]), row["ended"])
    return sum(end - start for start, end in ends.items())


@dataclass(frozen=True)
class Outcome:
    """A cell's statistics over the seeds: test and validation accuracy, epochs, and the difference to gat."""

    cell: Cell
    test: Summary
    val: Summary
    epochs: Summary
    difference: PairedDifference | None  # None for gat itself
    seconds: float

    def metrics(self) -> dict[str, float]:
        flat = {"test_acc_mean": self.test.mean, "test_acc_std": self.test.std, "test_acc_ci95_low": self.test.ci_low,
                "test_acc_ci95_high": self.test.ci_high, "val_acc_mean": self.val.mean,
                "epochs_mean": self.epochs.mean, "seeds": self.test.n, "worker_seconds": round(self.seconds, 1)}
        if self.difference is not None:
            d = self.difference
            flat |= {"diff_to_gat_mean": d.mean, "diff_to_gat_std": d.std, "diff_to_gat_ci95_low": d.ci_low,
                     "diff_to_gat_ci95_high": d.ci_high, "seeds_better_than_gat": d.better,
                     "seeds_worse_than_gat": d.worse, "seeds_tied_with_gat": d.tied}
        return flat


def outcomes(cells: Sequence[Cell], seeds: Sequence[int]) -> list[Outcome]:
    baseline = {cell.dataset: cell for cell in cells if cell.variant == BASELINE_ATTENTION}
    found = []
    for cell in cells:
        test = cell.values(seeds, "test_acc")
        difference = (None if cell.variant == BASELINE_ATTENTION else
                      paired_difference(test, baseline[cell.dataset].values(seeds, "test_acc")))
        test_acc, val_acc, epochs = (summarise(list(cell.values(seeds, column).values()))
                                     for column in ("test_acc", "val_acc", "epochs"))
        found.append(Outcome(cell, test_acc, val_acc, epochs, difference, worker_seconds(cell, seeds)))
    return found


def _points(value: float) -> str:
    """A difference of accuracies in percentage points, signed."""
    return f"{100 * value:+.2f}"


def report(found: Sequence[Outcome], facts: dict[str, str]) -> str:
    """reports/ablation.md."""
    lines = [
        "# Does attention matter? The attention variants on the same seeds", "",
        f"Made by `{facts['command']}` at commit `{facts['commit']}` on {facts['date']}, in {facts['wall']} "
        f"(wall time of that run; {facts['cached']}).", "",
        f"- Params: {facts['params']}.",
        f"- Machine: {facts['cpu_model']}, {facts['cores']} cores, {facts['platform']}, torch {torch.__version__}.",
        f"- CPU identity (gat.fused.cpu_identity): {facts['cpu']}.", "",
        "Each variant trains the same seeds with the dataset's `reproduce.protocol` block, only `model.attention` "
        "changed: `gat` the paper's, `gatv2` Brody et al. 2022's dynamic attention, `constant` every neighbour "
        "weighted equally. The difference to `gat` is paired by seed: seed s of a variant minus seed s of `gat`, "
        "and its 95% CI is Student's t interval of the mean of those per-seed differences (n - 1 degrees of "
        "freedom). An interval that excludes 0 is a difference these seeds resolve. \"Better / worse / tied\" counts "
        "the seeds on which the variant's test accuracy was above, below or equal to `gat`'s.", "",
        "| dataset | attention | seeds | test accuracy, mean ± std | 95% CI of the mean | difference to gat, mean "
        "| 95% CI of the difference (paired by seed) | seeds better / worse / tied | epochs, mean | training kernel "
        "| worker time |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for outcome in found:
        cell, test, d = outcome.cell, outcome.test, outcome.difference
        difference = ("baseline", "-", "-") if d is None else (
            f"{_points(d.mean)} points", f"[{_points(d.ci_low)}, {_points(d.ci_high)}] points",
            f"{d.better} / {d.worse} / {d.tied}")
        lines.append(f"| {cell.dataset} | {cell.variant} | {test.n} | {pct(test.mean)} ± {pct(test.std)} % "
                     f"| [{pct(test.ci_low)}, {pct(test.ci_high)}] % | {' | '.join(difference)} "
                     f"| {outcome.epochs.mean:.0f} | {cell.kernel} | {elapsed(outcome.seconds)} |")
    lines += ["", "Worker time: the cell's batches' training time, summed over the worker processes (cached seeds "
              "count the time they took when they were trained). The same table is the `gat-repro-ablation` "
              "experiment's runs in MLflow (`make ui`)."]
    return "\n".join(lines) + "\n"


def figure(found: Sequence[Outcome]):
    """Per dataset: each variant's mean test accuracy with its 95% CI, and each difference to gat with its CI."""
    import matplotlib.pyplot as plt  # stages.support.figures chose the Agg backend

    datasets = list(dict.fromkeys(outcome.cell.dataset for outcome in found))
    variants = list(dict.fromkeys(outcome.cell.variant for outcome in found))
    panels, grid = plt.subplots(len(datasets), 2, figsize=(11, 0.8 + (1.0 + 0.45 * len(variants)) * len(datasets)),
                                squeeze=False)
    for (means, differences), dataset in zip(grid, datasets):
        rows = [outcome for outcome in found if outcome.cell.dataset == dataset][::-1]  # the first variant on top
        positions = list(range(len(rows)))
        mean = [100 * o.test.mean for o in rows]
        means.errorbar(mean, positions, fmt="o", color="#4c72b0", capsize=4,
                       xerr=[[m - 100 * o.test.ci_low for m, o in zip(mean, rows)],
                             [100 * o.test.ci_high - m for m, o in zip(mean, rows)]])
        means.set_yticks(positions, [o.cell.variant for o in rows])
        means.set(xlabel="test accuracy (%), mean and 95% CI", title=f"{dataset}: {rows[0].test.n} seeds each",
                  ylim=(-0.6, len(rows) - 0.4))
        compared = [(i, o.difference) for i, o in enumerate(rows) if o.difference is not None]
        differences.axvline(0.0, color="black", linewidth=1)
        differences.plot([0.0] * (len(rows) - len(compared)), [i for i, o in enumerate(rows) if o.difference is None],
                         "D", color="black", label="gat: the baseline")
        if compared:
            d_mean = [100 * d.mean for _, d in compared]
            differences.errorbar(d_mean, [i for i, _ in compared], fmt="o", color="#dd8452", capsize=4,
                                 xerr=[[m - 100 * d.ci_low for m, (_, d) in zip(d_mean, compared)],
                                       [100 * d.ci_high - m for m, (_, d) in zip(d_mean, compared)]])
        differences.set_yticks(positions, [o.cell.variant for o in rows])
        differences.set(xlabel="difference to gat (points), paired by seed, 95% CI", title=f"{dataset}: minus gat",
                        ylim=(-0.6, len(rows) - 0.4))
        for axes in (means, differences):
            axes.grid(axis="x", alpha=0.3)
    panels.tight_layout()
    return panels


def _uncommitted() -> bool:
    """Whether this checkout's tracked files differ from its commit (the report then says so)."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, check=True, cwd=repo_root()).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def log_cell(outcome: Outcome, seeds: Sequence[int], meta: dict[str, Any], experiment_id: str) -> str:
    """The cell's run under the invocation's, with its summary, and one run per seed under it; its run id."""
    cell = outcome.cell
    tags = {**standard_tags(cell.dataset, meta["source_sha256"]), "dvc_stage": "(not a DVC stage: make ablation)",
            "variant": cell.variant, "training_kernel": cell.kernel}
    with stage_run(ABLATION_EXPERIMENT, f"{cell.dataset}-{cell.variant}", {
            **tags, ABLATION_LEVEL: "cell", "cached": f"{len(seeds) - cell.trained}/{len(seeds)} seeds",
            NOTE: f"`{cell.variant}` attention on {cell.dataset}, {len(seeds)} seeds: the test accuracy's mean, "
                  "std and 95% CI, and the difference to gat paired by seed; one child run per seed."},
                   nested=True) as run:
        mlflow.log_params(flatten(cell.setup))
        mlflow.log_metrics(outcome.metrics())
        rows = [{key: cell.rows[seed][key] for key in RESULT_COLUMNS} for seed in seeds]
        timings = {seed: (cell.rows[seed]["started"], cell.rows[seed]["ended"]) for seed in seeds}
        where = {seed: {key: str(cell.rows[seed][key]) for key in ("worker_host", "training_kernel")} for seed in seeds}
        log_child_runs(run.info.run_id, experiment_id, f"{cell.dataset}-{cell.variant}", rows, timings,
                       {**tags, ABLATION_LEVEL: "seed"}, where)
        return run.info.run_id


def run() -> None:
    started = time.monotonic()
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("data/prepared"),
                        help="the folder of the preprocess stage's outputs, one subfolder per dataset")
    parser.add_argument("--cache", type=Path, default=Path("data/ablation"))
    parser.add_argument("--report", type=Path, default=Path("reports/ablation.md"))
    parser.add_argument("--plot", type=Path, default=Path("reports/ablation.png"))
    args = parser.parse_args()
    params = load_params()
    settings, executor = params.ablation, params.reproduce
    device = device_for(executor.device, "reproduce.device")
    # Every input before any work: a missing dataset is one line naming the stage that makes it.
    prepared = {dataset: load_prepared(args.data / dataset, dataset) for dataset in settings.datasets}
    code_sha256()  # the training code as this run starts, which every worker must run too (check_same_code)
    seeds = list(range(settings.first_seed, settings.first_seed + settings.seeds))
    cells: list[Cell] = []
    for dataset, (graph, meta) in prepared.items():
        for variant in settings.variants:
            setup = variant_setup(executor.protocol[dataset], variant)
            kernel = planned_kernel(setup.model, setup.optim, graph.num_classes, device)
            cell = Cell(dataset, variant, setup, kernel, args.cache / dataset / variant,
                        fingerprint_of(dataset, meta["source_sha256"], setup, kernel))
            check_trainable(cell, graph)
            cell.rows, stale = read_cache(cell.folder, cell.fingerprint["fingerprint"])
            if stale:
                print(f"ablation {dataset} {variant}: {stale}", file=sys.stderr)
            cells.append(cell)
    missing = {id(cell): [seed for seed in seeds if seed not in cell.rows] for cell in cells}

    logged = logged_params(params, "ablation")
    commit = git_commit(repo_root())  # the code's, wherever it runs from
    parent_tags = {"git_commit": commit, "mlflow.source.git.commit": commit, ABLATION_LEVEL: "invocation",
                   "datasets": ",".join(settings.datasets), "variants": ",".join(settings.variants),
                   "executor": executor.executor, NOTE: describe_run(
                       f"The attention ablation: {', '.join(settings.variants)} on {', '.join(settings.datasets)}, "
                       f"seeds {seeds[0]} to {seeds[-1]} each; the report and its picture are this run's artifacts, "
                       "one child run per dataset and variant.", logged)}
    with starting_pool(executor.executor, executor.workers, device) as pool_when_ready, \
            stage_run(ABLATION_EXPERIMENT, f"ablation-{len(seeds)}-seeds", parent_tags) as parent:
        mlflow.log_params(logged)
        if any(missing.values()):
            # Workers start only when something is left to train; a stop kills them and ends the run FAILED, with
            # the batches finished so far in the cache.
            with pool_when_ready() as pool:
                mlflow.set_tag("workers_resolved", str(pool.size))
                if not isinstance(pool, WorkerPool):
                    print(f"ablation: on {pool.describe()}", file=sys.stderr)
                    check_same_code(pool.run_on_workers(code_sha256))
                    mlflow.set_tag("dask_scheduler", pool.address)
                for dataset, (graph, _meta) in prepared.items():
                    # Every variant's batches of a dataset at once, so that no worker waits for a cell to end.
                    work = [(cell, batch) for cell in cells if cell.dataset == dataset
                            for batch in batches(missing[id(cell)], executor.seeds_per_batch)]
                    if not work:
                        continue
                    with Progress(f"ablation {dataset}", "seeds", total=sum(len(b) for _, b in work)) as bar:
                        gather(pool, graph_to_tensors(graph), [(cell.setup, batch) for cell, batch in work], device,
                               bar, functools.partial(record_job, work))
        found = outcomes(cells, seeds)
        trained = sum(cell.trained for cell in cells)
        mlflow.set_tags({"training_kernels": ",".join(sorted({cell.kernel for cell in cells})),
                         "seeds_trained_now": str(trained)})
        cell_runs = [log_cell(outcome, seeds, prepared[outcome.cell.dataset][1], parent.info.experiment_id)
                     for outcome in found]
        cpu = cpu_identity()
        facts = {"command": shlex.join(["python", "-m", "stages.ablation", *sys.argv[1:]]),
                 "commit": commit + (" (with uncommitted changes)" if _uncommitted() else ""),
                 "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "wall": elapsed(time.monotonic() - started),
                 "cached": (f"{trained} of {len(seeds) * len(cells)} seeds trained by it, the others from the cache"
                            if trained < len(seeds) * len(cells) else "every seed trained by it"),
                 "params": ", ".join(f"`{key}: {value}`" for key, value in logged.items()
                                     if not key.startswith("reproduce.protocol.")),
                 "cpu_model": cpu.split("; flags:")[0], "cpu": cpu, "cores": str(os.cpu_count()),
                 "platform": platform.platform()}
        table = report(found, facts)
        picture = figure(found)
        mlflow.log_text(table, "ablation.md")
        mlflow.log_figure(picture, "ablation.png")
        mlflow.log_dict({"seeds": seeds, "cells": [{"dataset": o.cell.dataset, "variant": o.cell.variant,
                                                    "training_kernel": o.cell.kernel, **o.metrics()} for o in found]},
                        "ablation.json")
        with outputs_together():
            write_atomic(args.report, table)
            write_atomic(args.plot, png_bytes(picture))
    base = shown_uri().rstrip("/") if is_server(tracking_uri()) else LOCAL_UI
    where = "" if is_server(tracking_uri()) else " (with `make ui` running)"
    print(table, end="")
    print(f"\n{len(cells)} cells of {len(seeds)} seeds ({trained} trained now) -> {args.report}, {args.plot}; "
          f"MLflow store {shown_uri()}{where}:\n"
          f"  the cells side by side: {compare_url(base, cell_runs, [parent.info.experiment_id])}\n"
          f"  the ablation's runs: {ui_url(base, parent.info.experiment_id)}")


if __name__ == "__main__":
    main(run)
