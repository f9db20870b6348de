"""The reproduce stage's unit of work: a batch of seeds in, each seed's results out.

    result = train_seeds(graph_tensors, setup, [0, 1, 2, 3], torch.device("cpu"))
    result.rows      # one row per seed: test_acc, val_acc, epochs, best_epoch, weights_sha256 (seeds.csv)
    result.timings   # seed -> wall-clock (start, end) of its training (the child runs' times, not in seeds.csv)
    result.worker    # where it ran: host, torch and CPU facts (the child runs' tags, not in seeds.csv)

A pure function of its arguments: it reads no file, writes none and talks to no server, so it runs the
same in a local worker process (stages._workers) or on a Dask worker on another host (stages._dask), and
running it twice (Dask retries a task whose worker died) only costs time. The stage process alone logs.

This module imports only torch and the library: a Dask worker imports it to run the task.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

import gat
from gat.config import Setup
from gat.data import graph_from_tensors
from gat.model import GAT
from gat.training import EpochMetrics, GraphTensors, evaluate, train


# The files of the library whose content decides a result: Python and the native kernels' sources.
SOURCE_SUFFIXES = frozenset({".py", ".cpp", ".c", ".h", ".cu", ".cuh"})


class Abandoned(Exception):
    """The task was cancelled while it trained (its stage stopped): stop now, there is nobody to return to."""


@dataclass(frozen=True)
class BatchResult:
    """One batch's per-seed rows (what the params determine), and when and where they were computed."""

    rows: list[dict[str, Any]]  # seed, test_acc, val_acc, epochs, best_epoch, weights_sha256
    timings: dict[int, tuple[float, float]]
    worker: dict[str, str]


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


def _cpu_model() -> str:
    from gat.fused import cpu_facts

    facts = cpu_facts()
    return facts[0] if facts is not None and facts[0] != "?" else platform.processor() or "unknown"


@functools.lru_cache(maxsize=1)
def code_sha256() -> str:
    """SHA-256 over the library's sources (native ones included) and this module, as this process sees them: two
    processes with equal digests run the same training code (a Dask worker started from another checkout would
    not)."""
    package = Path(gat.__file__).parent
    sources = sorted(path for path in package.rglob("*") if path.suffix in SOURCE_SUFFIXES and path.is_file())
    digest = hashlib.sha256()
    for path in [*sources, Path(__file__)]:
        name = path.relative_to(package).as_posix() if path.is_relative_to(package) else path.name
        digest.update(f"{name}\0".encode() + path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _process_facts() -> dict[str, str]:
    return {"worker_host": socket.gethostname(), "worker_pid": str(os.getpid()),
            "torch_version": torch.__version__,
            # The vector instructions torch's CPU kernels dispatch to (AVX2, AVX512, ...): a different one can
            # round differently, the first thing to compare when two machines disagree.
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_mkl": str(torch.backends.mkl.is_available()),
            "cpu_model": _cpu_model(), "machine": platform.machine(),
            "python_version": platform.python_version(), "platform": sys.platform,
            "code_sha256": code_sha256()}


def worker_facts() -> dict[str, str]:
    """Where a batch ran: the host and the torch/CPU facts on which bit-identity across machines depends."""
    facts = {**_process_facts(), "torch_threads": str(torch.get_num_threads())}
    distributed = sys.modules.get("distributed")  # imported in a Dask worker, not in a local one
    if distributed is not None:
        try:
            facts["worker_address"] = distributed.get_worker().address
        except ValueError:  # not in a Dask task
            pass
    return facts


def train_seeds(graph_tensors: Mapping[str, Tensor], setup: Setup, seeds: Sequence[int], device: torch.device,
                should_stop: Callable[[], bool] | None = None) -> BatchResult:
    """Train one batch of seeds, restore each one's checkpoint and evaluate it.

    `graph_tensors` is gat.data.graph_to_tensors's plain form (sparse tensors pickle with a warning each
    time). `should_stop`, called once per epoch, ends the task with `Abandoned` when it returns True.
    """
    # One intra-op thread, as every stage: results are bit-identical at one thread (the README's Threads note),
    # and the parallelism comes from one worker per core.
    torch.set_num_threads(1)
    code_sha256()  # the code as it is when this process starts its first batch (a file edited later is not run)
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
                       {**worker_facts(), "training_kernel": result.kernel})
