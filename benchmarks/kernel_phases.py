"""Where a seed-epoch of the fused kernel goes, phase by phase, on Cora; or two kernels' phases side by side.

    python -m benchmarks.kernel_phases [--seeds 4] [--epochs 300] [--rounds 1]
    python -m benchmarks.kernel_phases --against HEAD --rounds 6 --epochs 100

This checkout's gat/csrc/fused.cpp is compiled into a temporary folder as `make` builds it, plus
`-DGAT_PHASE_TIMERS`: the kernel then sums each phase's wall time (a steady clock read at each phase's edges)
over every call. The paper's Cora model trains `--seeds` seeds on one thread, each epoch a training step and a
validation pass (gat.fused.FusedTrainer, the per-seed kernel as the native loop runs it), in `--rounds` blocks of
`--epochs` epochs. Prints, per seed-epoch, each phase's milliseconds (the median over the blocks, and their range)
and share of the wall time, and what no phase covers (Python, the validation loss, early-stopping bookkeeping).

With `--against REV`, REV's fused.cpp is built the same way and the two kernels take turns, block by block, in an
order that swaps every round (as benchmarks.kernel_ab's): a phase's time drifts by 10 % and more between runs on
these shared machines, so two kernels' phases are compared within one run. Prints each phase's medians and the
ratio of this checkout's to REV's.

A profiler's samples land on the instructions that wait, not on the phase that makes them wait; these timers
measure each phase whole. Nothing is written in the repository.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks.data import default_data_dir, load_graph
from benchmarks.kernel_ab import build_aside, build_revision, turns, warm_trainers
from gat import fused
from gat.data import Graph
from stages.support.params import StageError

TIMERS_FLAG = "-DGAT_PHASE_TIMERS"


def build_timed(folder: Path, revision: str | None = None) -> Any:
    """This checkout's kernel, or `revision`'s, built into `folder` with the phase timers, loaded."""
    if revision is None:
        built = build_aside(fused.SOURCE, folder / "fused_timed.so", (TIMERS_FLAG,), "this checkout's fused.cpp")
    else:
        built = build_revision(revision, folder, (TIMERS_FLAG,))
    lib = fused.load(built, earlier=revision is not None)
    if not hasattr(lib, "gat_phase_count"):
        raise StageError(f"{revision}'s fused.cpp has no phase timers: compare with a later commit")
    lib.gat_phase_name.restype = ctypes.c_char_p
    lib.gat_phase_ns.restype = ctypes.c_int64
    return lib


WALL = "the whole seed-epoch (wall)"
UNTIMED = "untimed: Python, the validation loss, bookkeeping"


def phase_samples(cora: Graph, libraries: dict[str, Any], seeds: int, epochs: int,
                  rounds: int) -> dict[str, dict[str, list[float]]]:
    """For each library, each phase's milliseconds per seed-epoch, what no phase covers (UNTIMED) and the whole
    epoch (WALL): one sample per block of `epochs` epochs, `rounds` blocks each, the libraries taking turns."""
    trainers = warm_trainers(cora, libraries, seeds, 10)
    per_seed_epoch = 1e3 / (seeds * epochs)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in libraries}
    for round_ in range(rounds):
        for name in turns(list(libraries), round_):
            lib = libraries[name]
            trainer, noise = trainers[name]
            lib.gat_phase_reset()
            start = time.perf_counter()
            for _ in range(epochs):
                trainer.step(noise)
                trainer.validate()
            wall = (time.perf_counter() - start) * per_seed_epoch
            phases = {lib.gat_phase_name(i).decode(): lib.gat_phase_ns(i) / 1e9 * per_seed_epoch
                      for i in range(lib.gat_phase_count())}
            for phase, ms in [*phases.items(), (UNTIMED, wall - sum(phases.values())), (WALL, wall)]:
                samples[name].setdefault(phase, []).append(ms)
    return samples


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4, help="seeds per call (a reproduce batch's)")
    parser.add_argument("--epochs", type=int, default=300, help="epochs per block, after 10 to warm up")
    parser.add_argument("--rounds", type=int, default=1, help="blocks per kernel")
    parser.add_argument("--against", help="a commit whose fused.cpp to time beside this checkout's, in turns")
    args = parser.parse_args(argv)
    if min(args.seeds, args.epochs, args.rounds) < 1:
        print("error: --seeds, --epochs and --rounds must be at least 1", file=sys.stderr)
        sys.exit(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="gat-kernel-phases-") as folder:
            libraries = {"this checkout": build_timed(Path(folder))}
            if args.against is not None:
                (Path(folder) / "against").mkdir()
                libraries[args.against] = build_timed(Path(folder) / "against", args.against)
            samples = phase_samples(load_graph(default_data_dir()), libraries, args.seeds, args.epochs, args.rounds)
    except (StageError, fused.FusedUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        torch.set_num_threads(threads)
    print(f"ms per seed-epoch ({args.seeds} seeds, {args.rounds} × {args.epochs} epochs, one thread), "
          f"median [min-max] of the blocks:")
    ours = samples["this checkout"]
    wall = statistics.median(ours[WALL])
    for phase, values in ours.items():
        ms = statistics.median(values)
        line = f"  {phase:<52} {ms:6.3f} [{min(values):.3f}-{max(values):.3f}]  {100 * ms / wall:5.1f} %"
        their_values = samples.get(args.against, {}).get(phase)
        if their_values:
            theirs = statistics.median(their_values)
            line += f"  {args.against}: {theirs:6.3f}" + (f"  ratio {ms / theirs:.3f}" if theirs > 0 else "")
        print(line)


if __name__ == "__main__":
    main()
