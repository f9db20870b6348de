"""Where a `reproduce` stage's time went, read back from its MLflow runs: the parent run and a child run per seed.

    python -m benchmarks.stage_timeline --dataset cora         # the latest reproduce run of Cora in the store
    python -m benchmarks.stage_timeline --run RUN_ID           # one parent run

The store is MLFLOW_TRACKING_URI's (`make repro`'s SQLite file at the repository root when unset), as for every
stage. Each child run starts when its seed's batch began to train on its worker and ends at the seed's last epoch
(stages.reproduce's `timings`); its tags name the worker and its `epochs` metric counts the seed's epochs. So the
seeds of a batch share a start, and a batch ends with its last seed. Relative to the parent run's start, this prints
when the first batch started and the last one ended, and how long the parent run went on after it (the summary, the
histogram, the child runs and the outputs); per worker, its batches, seeds and seed-epochs, its first start, its last
end and how long it then waited for the other workers; and the milliseconds per seed-epoch of the workers' wall time
in batches. The parent run opens once the stage has imported torch and MLflow and started its workers: those first
seconds are not in MLflow (`/usr/bin/time` gives the stage's whole wall time).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from stages.support.params import StageError, fail


@dataclass(frozen=True)
class SeedSpan:
    """One child run: the seed's worker, its training's start and end (seconds since the epoch), its epochs."""

    worker: str
    start: float
    end: float
    epochs: int


@dataclass(frozen=True)
class WorkerSpan:
    """One worker's share, in seconds from the parent run's start."""

    worker: str
    batches: int
    seeds: int
    seed_epochs: int
    start: float
    end: float
    idle_at_end: float  # from this worker's last end to the last end of any worker


@dataclass(frozen=True)
class Timeline:
    parent_s: float           # the parent run's duration
    first_start: float        # the first batch's start, from the parent run's start
    last_end: float           # the last seed's end, from the parent run's start
    after_training: float     # from the last seed's end to the parent run's end
    workers: tuple[WorkerSpan, ...]
    seed_epochs: int
    batch_seconds: float      # the batches' wall times, summed over the workers
    ms_per_seed_epoch: float  # batch_seconds per seed-epoch


def timeline(parent_start: float, parent_end: float, seeds: Sequence[SeedSpan]) -> Timeline:
    """The timeline of one parent run from its children. A batch is the seeds one worker started together."""
    if not seeds:
        raise ValueError("no child runs: nothing trained under this parent run")
    batches: dict[tuple[str, float], list[SeedSpan]] = defaultdict(list)
    for seed in seeds:
        batches[seed.worker, seed.start].append(seed)
    last_end = max(seed.end for seed in seeds)
    workers = []
    for worker in sorted({seed.worker for seed in seeds}):
        spans = [seed for seed in seeds if seed.worker == worker]
        end = max(seed.end for seed in spans)
        workers.append(WorkerSpan(worker, sum(1 for w, _ in batches if w == worker), len(spans),
                                  sum(seed.epochs for seed in spans), min(seed.start for seed in spans) - parent_start,
                                  end - parent_start, last_end - end))
    batch_seconds = sum(max(seed.end for seed in batch) - start for (_, start), batch in batches.items())
    seed_epochs = sum(seed.epochs for seed in seeds)
    return Timeline(parent_end - parent_start, min(seed.start for seed in seeds) - parent_start,
                    last_end - parent_start, parent_end - last_end, tuple(workers), seed_epochs, batch_seconds,
                    1000 * batch_seconds / seed_epochs if seed_epochs else float("nan"))


def describe(title: str, t: Timeline) -> str:
    lines = [title,
             f"  parent run: {t.parent_s:.2f} s; the first batch started {t.first_start:.2f} s in, the last seed "
             f"ended at {t.last_end:.2f} s, and the run ended {t.after_training:.2f} s after that"]
    for w in t.workers:
        lines.append(f"  {w.worker}: {w.batches} batches, {w.seeds} seeds, {w.seed_epochs:,} seed-epochs, "
                     f"{w.start:.2f} to {w.end:.2f} s, then {w.idle_at_end:.2f} s waiting for the last batch")
    lines.append(f"  in batches: {t.ms_per_seed_epoch:.3f} ms of a worker's wall time per seed-epoch "
                 f"({t.seed_epochs:,} seed-epochs in {t.batch_seconds:.1f} s)")
    return "\n".join(lines)


def _worker(tags: dict[str, str]) -> str:
    if tags.get("worker_address"):
        return tags["worker_address"]
    return f"{tags.get('worker_host', '?')} (pid {tags.get('worker_pid', '?')})"


def load(run_id: str | None, dataset: str | None) -> tuple[str, Timeline]:
    """The parent run (by id, else the latest finished reproduce run of `dataset`) and its timeline."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from stages.support.store import REPRODUCE_EXPERIMENT, connect

    experiment_id = connect(REPRODUCE_EXPERIMENT)
    client = MlflowClient()
    try:
        if run_id is None:
            found = client.search_runs(
                [experiment_id], f"tags.dataset = '{dataset}' and tags.`mlflow.parentRunId` IS NULL "
                                 "and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                max_results=1)
            if not found:
                fail(f"no finished reproduce run of {dataset!r} in this MLflow store: run `dvc repro` "
                     "(or python -m stages.reproduce) first, or pass --run")
            parent = found[0]
        else:
            parent = client.get_run(run_id)
        children = client.search_runs([parent.info.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=50000)
    except MlflowException as error:
        fail(f"could not read the runs: {str(error).splitlines()[0]}")
    if parent.info.end_time is None:
        fail(f"run {parent.info.run_id} has not ended ({parent.info.status}): its timeline is not complete")
    seeds = [SeedSpan(_worker(child.data.tags), child.info.start_time / 1000, child.info.end_time / 1000,
                      int(child.data.metrics.get("epochs", 0))) for child in children
             if child.info.end_time is not None]
    if not seeds:
        fail(f"run {parent.info.run_id} has no child runs: is it a reproduce stage's parent run?")
    title = (f"reproduce {parent.data.tags.get('dataset', '?')}, run {parent.info.run_id} "
             f"({parent.info.run_name}), {len(seeds)} seeds")
    return title, timeline(parent.info.start_time / 1000, parent.info.end_time / 1000, seeds)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--dataset", help="the latest finished reproduce run of this dataset")
    which.add_argument("--run", help="a reproduce stage's parent run id")
    args = parser.parse_args(argv)
    try:
        title, t = load(args.run, args.dataset)
    except StageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(describe(title, t))


if __name__ == "__main__":
    main()
