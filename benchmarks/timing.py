"""What is measured and how: the table's cases, their interleaved timing, and peak memory per process."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import psutil
import torch

from benchmarks.implementations import (Runner, build_dense, build_engine, build_fused, build_native_loop, build_pyg,
                                        describe_dense_graph)
from gat.config import Attention
from gat.data import Graph

# torch's intra-op thread count before the benchmark changes it: one per core unless OMP_NUM_THREADS says otherwise.
DEFAULT_THREADS = torch.get_num_threads()

# model.attention's values, the paper's first: each is timed on this engine against PyG's GATConv and GATv2Conv.
ATTENTION_VARIANTS: tuple[Attention, ...] = typing.get_args(Attention)

# Consecutive timed calls per turn: a training loop runs step after step with its data in cache.
BURST = 5

MIB = 2**20


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


@dataclass(frozen=True)
class Case:
    """One row of the table: an implementation at a thread count.

    `replicas` seeds train in one model; the row reports the time per seed (per call / replicas).
    """

    key: str
    label: str
    build: Callable[[Graph], Runner]
    threads: int
    graph: str
    eval_scope: str
    warmup: int
    repeats: int
    replicas: int = 1
    burst: int = 1   # timed calls in a row at each turn, as in a training loop, after `rewarm` untimed ones
    rewarm: int = 0  # untimed calls at each turn: the other implementations ran in between and evicted the caches
    reference: bool = False  # a PyG case: the faster one sets the ratios
    full_graph: bool = True  # False: a subgraph, whose times are not comparable with the reference's


def cases(graph: Graph, *, repeats: int, warmup: int, dense_repeats: int, dense_warmup: int,
          batched_seeds: int, dense_nodes: int) -> list[Case]:
    """Everything timed, in table order."""
    seeds = tuple(range(batched_seeds))
    val = f"validation loss and accuracy on the {graph.val_idx.numel()} validation nodes"
    fast: dict[str, Any] = dict(warmup=warmup, repeats=repeats, burst=BURST, rewarm=1)
    engine_eval = f"gat.training.evaluate: whole-graph forward pass, then {val} (and the test split's)"
    listed = [
        Case("engine", "this engine (1 seed)", build_engine, 1, "full Cora (training nodes' receptive field)",
             engine_eval, **fast),
        Case("engine_batched", f"this engine, per seed of {batched_seeds} batched",
             lambda g: build_engine(g, seeds), 1, "full Cora (training nodes' receptive field)",
             engine_eval, replicas=batched_seeds, **fast),
        Case("engine_epoch_validation", "this engine (1 seed), eval = train's per-epoch validation pass",
             lambda g: build_engine(g, per_epoch_validation=True), 1, "full Cora (training nodes' receptive field)",
             f"gat.training.NodeView: the validation nodes' receptive field only, then {val}", **fast),
        Case("fused", "fused kernel (1 seed), eval = train's per-epoch validation pass", build_fused, 1,
             "full Cora (training nodes' receptive field)",
             f"gat.fused: the validation nodes' receptive field only, then {val}", **fast),
        Case("fused_batched", f"fused kernel, per seed of {batched_seeds} batched, eval = per-epoch validation",
             lambda g: build_fused(g, seeds), 1, "full Cora (training nodes' receptive field)",
             f"gat.fused: the validation nodes' receptive field only, then {val}", replicas=batched_seeds, **fast),
        Case("fused_native", f"fused kernel's native loop (reproduce's), per seed of {batched_seeds}, "
             "eval = its validation pass", lambda g: build_native_loop(g, seeds), 1,
             "full Cora (training nodes' receptive field)",
             f"gat.fused.SeedLanes: inside each epoch's call, timed by the kernel; the validation nodes' receptive "
             f"field only, then {val}", replicas=batched_seeds, **fast),
    ]
    # The attention variants (model.attention) on the torch kernel, which alone serves them; gat's row is `engine`.
    for attention in ATTENTION_VARIANTS[1:]:
        listed.append(Case(f"engine_{attention}", f"this engine (1 seed), attention: {attention}",
                           functools.partial(build_engine, attention=attention), 1,
                           "full Cora (training nodes' receptive field)", engine_eval, **fast))
    for threads in sorted({1, DEFAULT_THREADS}):
        listed.append(Case(f"pyg_{threads}t", f"PyG GATConv ({threads} thread{'s' * (threads > 1)})", build_pyg,
                           threads, "full Cora", f"whole-graph forward pass, then {val}", reference=True, **fast))
    for threads in sorted({1, DEFAULT_THREADS}):
        listed.append(Case(f"pyg_gatv2_{threads}t", f"PyG GATv2Conv ({threads} thread{'s' * (threads > 1)})",
                           functools.partial(build_pyg, conv="GATv2Conv"), threads, "full Cora",
                           f"whole-graph forward pass, then {val}", **fast))
    listed.append(Case("dense", "dense tutorial layer", lambda g: build_dense(g, dense_nodes), DEFAULT_THREADS,
                       describe_dense_graph(graph, dense_nodes), f"forward pass on that graph, then the {val} in it",
                       warmup=dense_warmup, repeats=dense_repeats, full_graph=dense_nodes == graph.num_nodes))
    return listed


def interleaved_schedule(repeats: Mapping[str, int]) -> list[str]:
    """The order of the timed calls: each key's repetitions spread evenly over the rounds of the most-repeated.

    A key with n of R rounds runs in the rounds where floor(i·n/R) steps up, so it gets exactly n slots.
    """
    rounds = max(repeats.values())
    return [key for i in range(rounds) for key, n in repeats.items() if (i + 1) * n // rounds > i * n // rounds]


@dataclass
class Samples:
    """Per-call wall times (ms) of one case, and its last losses (to show that it really trained)."""

    train_ms: list[float] = field(default_factory=list)
    eval_ms: list[float] = field(default_factory=list)
    train_loss: float = float("nan")
    val_loss: float = float("nan")


def run_once(runner: Runner, samples: Samples | None = None) -> None:
    """One training step and one evaluation pass, timed into `samples` when given.

    CPU ops are synchronous, so a call's return is the end of its work.
    """
    start = time.perf_counter()
    train_loss = runner.train_step()
    middle = time.perf_counter()
    val_loss, _ = runner.eval_pass()
    end = time.perf_counter()
    inside = 0.0 if runner.eval_inside_step is None else runner.eval_inside_step()
    if samples is not None:
        samples.train_ms.append((middle - start) * 1e3 - inside)
        samples.eval_ms.append((end - middle) * 1e3 + inside)
        samples.train_loss, samples.val_loss = float(train_loss.mean()), float(val_loss.mean())


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, including time the hypervisor stole; this process's)."""
    machine_times = psutil.cpu_times()
    busy = sum(getattr(machine_times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


def other_cpu_share(before: tuple[float, float], after: tuple[float, float], wall_s: float) -> float:
    """The share of the machine's capacity (cores x wall time) that others used meanwhile: 0 = otherwise idle."""
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (wall_s * (os.cpu_count() or 1))


def measure(graph: Graph, listed: Sequence[Case],
            log: Callable[[str], None] = print) -> tuple[dict[str, Samples], float]:
    """Build every case, warm each up, then time them interleaved; each call runs at its case's thread count.

    Returns the samples per case and the share of the CPUs other processes used during the timed calls
    (a busy neighbour slows the two-thread cases most: OpenMP waits for its slowest thread).
    """
    runners, samples = {}, {}
    for case in listed:
        torch.set_num_threads(case.threads)
        log(f"building and warming up {case.label} ({case.threads} thread(s), {case.warmup} warm-up calls)")
        runners[case.key] = case.build(graph)
        for _ in range(case.warmup):
            run_once(runners[case.key])
        samples[case.key] = Samples()
    by_key = {case.key: case for case in listed}
    schedule = interleaved_schedule({case.key: -(-case.repeats // case.burst) for case in listed})
    log(f"timing {len(schedule)} interleaved turns of consecutive (training step, evaluation pass) pairs")
    before, start = busy_cpu_seconds(), time.perf_counter()
    for key in schedule:
        case = by_key[key]
        torch.set_num_threads(case.threads)
        for call in range(case.rewarm + case.burst):
            run_once(runners[key], samples[key] if call >= case.rewarm else None)
    share = other_cpu_share(before, busy_cpu_seconds(), time.perf_counter() - start)
    torch.set_num_threads(DEFAULT_THREADS)
    return samples, share


def own_peak_rss_mb() -> float:
    """This process's peak resident set size so far: VmHWM of /proc/self/status.

    Not ru_maxrss: Linux carries into it the high-water mark of the memory a process had before
    `execve`, and a child starts out with its parent's memory (fork or vfork), so every peak process
    would report at least the (large) benchmark parent's peak. VmHWM belongs to the new image alone.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS needs Linux")


def peak_of(case: Case, graph: Graph, epochs: int) -> dict:
    """What a `--peak-of` process reports: its peak RSS after building `case` and training it `epochs` epochs."""
    torch.set_num_threads(case.threads)
    runner = case.build(graph)
    for _ in range(epochs):
        run_once(runner)
    return {"peak_rss_mb": own_peak_rss_mb(), "epochs": epochs, "threads": case.threads}


# A fresh interpreter that imports torch and reports its VmHWM (see own_peak_rss_mb) in MB.
BASELINE_SNIPPET = ("import re, torch; from pathlib import Path; "
                    "print(int(re.search(r'VmHWM:\\s+(\\d+)', Path('/proc/self/status').read_text())[1]) / 1024)")


def baseline_rss_mb() -> float:
    """Peak RSS of a fresh Python that imported torch and nothing else."""
    out = subprocess.run([sys.executable, "-c", BASELINE_SNIPPET], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())
