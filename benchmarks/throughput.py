"""The fused kernel against the torch kernel where it counts: seed-epochs per second of a reproduce worker."""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from benchmarks import stage_ab, train_ab
from benchmarks.data import protocol
from benchmarks.report import FUSED_SPEEDUP_TARGET, LANES_SPEEDUP_TARGET, STAGE_WALL_TARGET_S
from benchmarks.timing import percentile
from gat import fused
from gat.config import OptimConfig
from gat.data import Graph
from gat.training import GraphTensors, train
from stages.support.params import StageError


def reproduce_throughput(graph: Graph, seeds: int, epochs: int, rounds: int) -> dict:
    """Seed-epochs per second of `gat.training.train` with each kernel, as a reproduce worker runs a batch.

    One intra-op thread (stages.reproduce runs one worker per core), `seeds` seeds in one model, `epochs`
    epochs each (patience above max_epochs, so no seed stops early): the training steps, the per-epoch
    validation passes, early-stopping bookkeeping and checkpoints. The kernels take turns, `rounds` times.
    Seconds are this process's CPU time, the wall time of a worker that has its core to itself: on a
    machine whose cores other processes share, wall time would measure their load as much as the kernels
    (it is reported too).
    """
    reason = fused.unavailable_reason()
    if reason is not None:
        raise StageError(f"the fused kernel is unavailable ({reason}): run `make bench`, which builds it")
    paper = protocol()
    tensors = GraphTensors.from_graph(graph)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu: dict[str, list[float]] = {"fused": [], "torch": []}
    wall: dict[str, list[float]] = {"fused": [], "torch": []}
    try:
        for _ in range(rounds):
            for kernel in cpu:
                optim = OptimConfig(paper.optim.lr, paper.optim.weight_decay, max_epochs=epochs, patience=epochs + 1,
                                    kernel=kernel)  # type: ignore[arg-type]
                start, start_cpu = time.perf_counter(), time.process_time()
                train(tensors, paper.model, optim, range(seeds))
                cpu[kernel].append(time.process_time() - start_cpu)
                wall[kernel].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)

    def rates(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
        return {kernel: [seeds * epochs / s for s in samples] for kernel, samples in seconds.items()}

    median = {kernel: percentile(values, 50) for kernel, values in rates(cpu).items()}
    median_wall = {kernel: percentile(values, 50) for kernel, values in rates(wall).items()}
    speedup = median["fused"] / median["torch"]
    return {"seeds_per_batch": seeds, "epochs": epochs, "threads": 1, "rounds": rounds, "clock": "process CPU time",
            "seed_epochs_per_s": median, "seed_epochs_per_s_samples": rates(cpu),
            "seed_epochs_per_wall_s": median_wall, "seed_epochs_per_wall_s_samples": rates(wall),
            "fused_vs_torch": speedup, "fused_vs_torch_wall": median_wall["fused"] / median_wall["torch"],
            "target": FUSED_SPEEDUP_TARGET, "met": bool(speedup >= FUSED_SPEEDUP_TARGET)}


@contextmanager
def lanes(width: int | None) -> Iterator[None]:
    """$GAT_FUSED_LANES set to `width` (None: unset, the default) for the duration."""
    before = os.environ.pop(fused.LANES_VARIABLE, None)
    if width is not None:
        os.environ[fused.LANES_VARIABLE] = str(width)
    try:
        yield
    finally:
        os.environ.pop(fused.LANES_VARIABLE, None)
        if before is not None:
            os.environ[fused.LANES_VARIABLE] = before


def loop_name(width: int) -> str:
    """A point's loop: the Python epoch loop (the reference), the per-seed kernel in the native loop, or lanes."""
    return {fused.PYTHON_LOOP: "Python loop", 1: "native per-seed"}.get(width, f"lanes of {width}")


REFERENCE = "Python loop, 4 seeds"  # the fused kernel as issue 22 found it: FusedTrainer, 4 seeds per batch
# The curve: ($GAT_FUSED_LANES, seeds per batch); the first point is the reference.
LANE_CURVE = ((fused.PYTHON_LOOP, 4), (fused.PYTHON_LOOP, 16), (1, 4), (1, 16), (1, 50), (4, 4), (8, 8), (16, 16),
              (16, 32))


def lane_curve(graph: Graph, epochs: int, rounds: int, points: tuple[tuple[int, int], ...] = LANE_CURVE) -> dict:
    """Seed-epochs per CPU second of `gat.training.train` with `kernel: fused` at each ($GAT_FUSED_LANES, seeds per
    batch) of `points`, against the Python epoch loop with 4 seeds (which `points` must hold): one thread, `epochs`
    epochs, no early stop, the points taking turns `rounds` times. Every point trains the same seeds to the same
    bytes; only the time differs."""
    reason = fused.unavailable_reason()
    if reason is not None:
        raise StageError(f"the fused kernel is unavailable ({reason}): run `make bench`, which builds it")
    paper = protocol()
    tensors = GraphTensors.from_graph(graph)
    optim = OptimConfig(paper.optim.lr, paper.optim.weight_decay, max_epochs=epochs, patience=epochs + 1,
                        kernel="fused")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for width, seeds in points:
                with lanes(width):
                    start = time.process_time()
                    train(tensors, paper.model, optim, range(seeds))
                    elapsed = time.process_time() - start
                samples.setdefault(f"{loop_name(width)}, {seeds} seeds", []).append(seeds * epochs / elapsed)
    finally:
        torch.set_num_threads(threads)
    median = {key: percentile(values, 50) for key, values in samples.items()}
    reference = median[REFERENCE]
    best = max((key for key in median if not key.startswith("Python")), key=median.__getitem__)
    speedup = median[best] / reference
    return {"epochs": epochs, "rounds": rounds, "threads": 1, "clock": "process CPU time", "reference": REFERENCE,
            "seed_epochs_per_s": median, "seed_epochs_per_s_samples": samples,
            "vs_reference": {key: value / reference for key, value in median.items()},
            "best": best, "best_vs_reference": speedup}


# The last commit before issue 22's work: the fused kernel between Python's calls, 4 seeds per batch.
ISSUE_22_START = "10746975d199c54d61256f1db92538710112abae"


def against_issue_22_start(data_dir: Path, verify: bool, seeds: int, epochs: int, rounds: int) -> dict:
    """Issue 22's throughput target: seed-epochs per CPU second of `train` with `kernel: fused`, this checkout's
    own code against ISSUE_22_START's (benchmarks.train_ab, its kernel built aside), in turns."""
    compared = train_ab.against_revision(ISSUE_22_START, seeds, epochs, rounds, data_dir, verify)
    return {**compared, "target": LANES_SPEEDUP_TARGET, "met": bool(compared["speedup"] >= LANES_SPEEDUP_TARGET)}


def stage_targets(compared: dict) -> dict:
    """benchmarks.stage_ab's comparison with ISSUE_22_START, and issue 22's two targets for the stage: seed-epochs per
    CPU second (`met`) and this checkout's median wall time (`wall_met`)."""
    wall = statistics.median(compared["wall_s_samples"]["this checkout"])
    return {**compared, "target": LANES_SPEEDUP_TARGET, "met": bool(compared["speedup"] >= LANES_SPEEDUP_TARGET),
            "wall_s": wall, "wall_target_s": STAGE_WALL_TARGET_S, "wall_met": bool(wall <= STAGE_WALL_TARGET_S)}


def stage_against_issue_22_start(raw_dir: Path, rounds: int) -> dict:
    """Issue 22's throughput target as the issue words it, seed-epochs per CPU second of `reproduce`: Cora's whole
    stage, this checkout's against ISSUE_22_START's (benchmarks.stage_ab: each side's own stage, its worker processes'
    CPU time included, on Cora prepared from `raw_dir` by this checkout's preprocess stage), in turns."""
    return stage_targets(stage_ab.against_revision(ISSUE_22_START, "cora", None, rounds, raw_dir))
