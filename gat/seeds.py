"""The reproduce stage's unit of work: a batch of seeds in, each seed's results out.

    result = train_seeds(graph_tensors, setup, [0, 1, 2, 3], torch.device("cpu"))
    result.rows      # one row per seed: test_acc, val_acc, epochs, best_epoch, weights_sha256 (seeds.csv)
    result.timings   # seed -> wall-clock (start, end) of its training (the child runs' times, not in seeds.csv)
    result.worker    # where it ran: here only the kernel that trained; the executor adds host, torch and CPU facts

A pure function of its arguments: it reads no file, writes none and talks to no server, so it runs the
same in a local worker process or on a Dask worker on another host, and running it twice (Dask retries a
task whose worker died) only costs time. The stage process alone logs.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from gat.config import Setup
from gat.data import graph_from_tensors
from gat.model import GAT
from gat.training import EpochMetrics, GraphTensors, evaluate, train


class Abandoned(Exception):
    """The task was cancelled while it trained (its stage stopped): stop now, there is nobody to return to."""


@dataclass(frozen=True)
class BatchResult:
    """One batch's per-seed rows (what the params determine), and when and where they were computed."""

    rows: list[dict[str, Any]]  # seed, test_acc, val_acc, epochs, best_epoch, weights_sha256
    timings: dict[int, tuple[float, float]]
    worker: dict[str, str]


def batches(seeds: Sequence[int], size: int, workers: int = 1) -> list[list[int]]:
    """`seeds` in order, in batches of `size`, but the last round's batches ever smaller when there are `workers`.

    Each worker takes the next batch as it finishes one, so the last batches decide when the stage ends: the workers
    finish their last full batches at different times, and one that waits for the other idles a core. So the seeds
    after the last full round (one batch of `size` per worker) go into batches that each hold 1 / (2 · `workers`) of
    the seeds left, rounded up, down to single seeds: the workers end within about one seed's training of each other.
    100 seeds in batches of 4 on 2 workers: 24 batches of 4, then 4 of 1. One worker has nobody to wait for, and
    keeps plain batches. A seed's results never depend on its batch.
    """
    round_ = size * workers
    whole = len(seeds) // round_ * round_ if workers > 1 else len(seeds)
    planned = [list(seeds[start:start + size]) for start in range(0, whole, size)]
    start = whole
    while start < len(seeds):
        count = -(-(len(seeds) - start) // (2 * workers))  # ceil
        planned.append(list(seeds[start:start + count]))
        start += count
    return planned


def weights_sha256(model: GAT, replica: int) -> str:
    """SHA-256 of one replica's weights: every state-dict entry in name order, as name, dtype, shape and the
    raw bytes of its slice. Equal hashes mean bit-identical networks, whatever batch the replica trained in.

    Shapes: every entry of model.state_dict() is [R, ...]; the replica's slice is [...].
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        part = tensor[replica].detach().cpu().contiguous()
        digest.update(f"{name}|{part.dtype}|{tuple(part.shape)}|".encode())
        digest.update(part.numpy().tobytes())
    return digest.hexdigest()



def train_seeds(graph_tensors: Mapping[str, Tensor], setup: Setup, seeds: Sequence[int], device: torch.device,
                should_stop: Callable[[], bool] | None = None) -> BatchResult:
    """Train one batch of seeds, restore each one's checkpoint and evaluate it.

    `graph_tensors` is gat.data.graph_to_tensors's plain form (sparse tensors pickle with a warning each
    time). `should_stop`, called once per epoch, ends the task with `Abandoned` when it returns True.
    """
    # One intra-op thread, as every stage: results are bit-identical at one thread (the README's Threads note),
    # and the parallelism comes from one worker per core.
    torch.set_num_threads(1)
    tensors = GraphTensors.from_graph(graph_from_tensors(graph_tensors), device)
    started = time.time()
    last_epoch_at = {seed: started for seed in seeds}

    def on_epoch(m: EpochMetrics) -> None:
        if should_stop is not None and should_stop():
            raise Abandoned(f"seeds {list(seeds)}: cancelled at epoch {m.epoch}")
        now = time.time()
        last_epoch_at.update((seed, now) for seed in m.seeds)

    result = train(tensors, setup.model, setup.optim, seeds, on_epoch)
    scores = evaluate(result.model, tensors)
    rows: list[dict[str, Any]] = [
        {"seed": seed, "test_acc": float(scores.test_acc[r]), "val_acc": float(scores.val_acc[r]),
         "epochs": int(result.epochs[r]), "best_epoch": int(result.best_epoch[r]),
         "weights_sha256": weights_sha256(result.model, r)}
        for r, seed in enumerate(result.seeds)]
    return BatchResult(rows, {seed: (started, last_epoch_at[seed]) for seed in result.seeds},
                       {"training_kernel": result.kernel})
