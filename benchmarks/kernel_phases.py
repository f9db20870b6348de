"""Where a seed-epoch of the fused kernel goes, phase by phase, on Cora.

    python -m benchmarks.kernel_phases [--seeds 4] [--epochs 300]

This checkout's gat/csrc/fused.cpp is compiled into a temporary folder as `make` builds it, plus
`-DGAT_PHASE_TIMERS`: the kernel then sums each phase's wall time (a steady clock read at each phase's edges)
over every call. The paper's Cora model trains `--seeds` seeds for `--epochs` epochs on one thread, each epoch a
training step and a validation pass (gat.fused.FusedTrainer, the per-seed kernel as the native loop runs it).
Prints, per seed-epoch, each phase's milliseconds and share of the wall time, and what no phase covers (Python,
the validation loss, early-stopping bookkeeping). A profiler's samples land on the instructions that wait, not
on the phase that makes them wait; these timers measure each phase whole. Nothing is written in the repository.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks.data import default_data_dir, load_graph, protocol
from benchmarks.kernel_ab import build_aside
from gat import fused
from gat.data import Graph
from gat.dropout import ReplicaDropout
from gat.model import GAT
from gat.training import GraphTensors, NodeView
from stages.support.params import StageError

TIMERS_FLAG = "-DGAT_PHASE_TIMERS"


def build_timed(folder: Path) -> Any:
    """This checkout's kernel, built into `folder` with the phase timers, loaded."""
    lib = fused.load(build_aside(fused.SOURCE, folder / "fused_timed.so", (TIMERS_FLAG,), "this checkout's fused.cpp"))
    lib.gat_phase_name.restype = ctypes.c_char_p
    lib.gat_phase_ns.restype = ctypes.c_int64
    return lib


def phase_times(cora: Graph, lib: Any, seeds: int, epochs: int) -> tuple[dict[str, float], float]:
    """Milliseconds per seed-epoch of each phase, and of the whole epoch (wall), over `epochs` epochs."""
    graph = GraphTensors.from_graph(cora)
    paper = protocol()
    train_view, val_view = (NodeView.of(graph, nodes, 2) for nodes in (graph.train_idx, graph.val_idx))
    model = GAT(paper.model, graph.x.num_features, graph.num_classes, tuple(range(seeds)))
    trainer = fused.FusedTrainer(model, paper.optim.lr, paper.optim.weight_decay, train_view, val_view, lib=lib)
    noise = ReplicaDropout(tuple(range(seeds)), paper.model.dropout)
    for _ in range(10):  # warm: the workspaces allocated, the data in cache
        trainer.step(noise)
        trainer.validate()
    lib.gat_phase_reset()
    start = time.perf_counter()
    for _ in range(epochs):
        trainer.step(noise)
        trainer.validate()
    wall = time.perf_counter() - start
    per_seed_epoch = 1e3 / (seeds * epochs)
    phases = {lib.gat_phase_name(i).decode(): lib.gat_phase_ns(i) / 1e9 * per_seed_epoch
              for i in range(lib.gat_phase_count())}
    return phases, wall * per_seed_epoch


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4, help="seeds per call (a reproduce batch's)")
    parser.add_argument("--epochs", type=int, default=300, help="epochs timed, after 10 to warm up")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.epochs < 1:
        print("error: --seeds and --epochs must be at least 1", file=sys.stderr)
        sys.exit(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="gat-kernel-phases-") as folder:
            phases, wall = phase_times(load_graph(default_data_dir()), build_timed(Path(folder)), args.seeds,
                                       args.epochs)
    except (StageError, fused.FusedUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        torch.set_num_threads(threads)
    print(f"ms per seed-epoch ({args.seeds} seeds, {args.epochs} epochs, one thread):")
    untimed = ("untimed: Python, the validation loss, bookkeeping", wall - sum(phases.values()))
    for name, ms in [*phases.items(), untimed]:
        print(f"  {name:<52} {ms:6.3f}  {100 * ms / wall:5.1f} %")
    print(f"  {'the whole seed-epoch (wall)':<52} {wall:6.3f}  100.0 %")


if __name__ == "__main__":
    main()
