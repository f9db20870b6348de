"""The ablation's cells and their cache: a cell's setup and fingerprint, its seeds' rows read from and written to
`<cache>/<dataset>/<variant>/` (seeds.csv beside fingerprint.json), and the batches that fill it."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gat.config import Setup
from gat.seeds import BatchResult
from stages.support.files import outputs_together, write_csv, write_json
from stages.support.seed_pool import check_same_code
from stages.support.seed_task import code_sha256
from stages.support.tracking import data_digest

# A seed's results, as gat.seeds.train_seeds gives them (seeds.csv's first columns, and each seed run's metrics).
RESULT_COLUMNS = ("seed", "test_acc", "val_acc", "epochs", "best_epoch", "weights_sha256")
# Where and when it trained: the seed run's times and tags, kept in the cache so a cached seed logs them again.
WHERE_COLUMNS = ("started", "ended", "worker_host", "training_kernel")
TYPES = {"seed": int, "epochs": int, "best_epoch": int, "test_acc": float, "val_acc": float, "started": float,
         "ended": float}


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
