"""The ablation's results: each cell's statistics over the seeds (gat.reproduction's summaries and the difference
to gat paired by seed), and reports/ablation.md with the facts of the run that made it."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import torch

from gat.config import BASELINE_ATTENTION
from gat.fused import cpu_identity
from gat.reproduction import PairedDifference, Summary, paired_difference, summarise
from stages.support.ablation_cache import Cell, worker_seconds
from stages.support.params import repo_root
from stages.support.progress import elapsed
from stages.support.tables import pct


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


def _uncommitted() -> bool:
    """Whether this checkout's tracked files differ from its commit (the report then says so)."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, check=True, cwd=repo_root()).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def made_by(started: float, commit: str, trained: int, total: int, logged: Mapping[str, Any]) -> dict[str, str]:
    """What the report says of the run that made it: the command, commit, date, wall time since `started`
    (time.monotonic), how many of the `total` seeds it `trained`, its params and the machine."""
    cpu = cpu_identity()
    return {"command": shlex.join(["python", "-m", "stages.ablation", *sys.argv[1:]]),
            "commit": commit + (" (with uncommitted changes)" if _uncommitted() else ""),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "wall": elapsed(time.monotonic() - started),
            "cached": (f"{trained} of {total} seeds trained by it, the others from the cache"
                       if trained < total else "every seed trained by it"),
            "params": ", ".join(f"`{key}: {value}`" for key, value in logged.items()
                                if not key.startswith("reproduce.protocol.")),
            "cpu_model": cpu.split("; flags:")[0], "cpu": cpu, "cores": str(os.cpu_count()),
            "platform": platform.platform()}


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
