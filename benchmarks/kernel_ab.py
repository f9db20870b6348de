"""This checkout's fused kernel against an earlier commit's, in one process, taking turns.

    python -m benchmarks.kernel_ab --against dbe43d7
    python -m benchmarks.kernel_ab --against HEAD --extra-flags=-ffp-contract=fast
    python -m benchmarks.kernel_ab --against f5c84bc --native
    python -m benchmarks.kernel_ab --first-w-layouts --seeds 16

These shared machines run 1.3 to 1.7 times faster on some days than on others, so a kernel is compared with an
older one in the same run: the older commit's gat/csrc/fused.cpp (`git show`) is compiled with this checkout's flags
into a temporary folder, both libraries are loaded, and each times Cora's paper model for `--seeds` seeds on one
thread in alternating blocks of `--block` calls. The order of the two turns swaps every round (A B, B A, A B, ...),
so that neither kernel is always the one timed first after the other. By default the per-seed kernel between
Python's calls (gat.fused.FusedTrainer: a training step and a validation pass, one call each); with `--native`, the
native loop `reproduce` trains with (gat.fused.SeedLanes with lanes of 1: whole epochs, dropout masks and early
stopping included; no seed stops early here). Prints, per seed, the median and range over the blocks and the ratio
of this checkout's median to the older one's. Nothing is written in the repository.

With `--first-w-layouts`, no older commit: this checkout's native loop twice, keeping the paper's first W by input
feature (its Adam update row by row) against transposing it in every pass, the two layouts the kernel chooses between
by the L2 cache's size (gat.fused.SeedLanes); the ratio is by feature / transposed, so below 1 says that this CPU
should keep W by feature. The same bytes either way.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks.data import default_data_dir, load_graph, protocol
from gat import fused
from gat.config import Setup
from gat.data import Graph
from gat.dropout import ReplicaDropout
from gat.model import GAT
from gat.training import GraphTensors, NodeView
from stages.support.params import StageError

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_aside(source: Path, library: Path, extra_flags: Sequence[str], described: str) -> Path:
    """`source` built into `library` as `make` builds this checkout's kernel, with `extra_flags` after its flags;
    `described` names the source in the error."""
    compiler = fused.compiler()
    if compiler is None:
        raise StageError("no C++ compiler on PATH: install g++ (`make system-deps`) or set $CXX")
    built = subprocess.run(fused.compile_command(compiler, source, library, extra_flags), capture_output=True,
                           text=True)
    if built.returncode != 0:
        flags = f" with {' '.join(extra_flags)}" if extra_flags else ""
        raise StageError(f"{described} does not compile here{flags}: "
                         f"{(built.stderr.strip().splitlines() or ['?'])[-1]}")
    return library


def build_revision(revision: str, folder: Path, extra_flags: Sequence[str] = ()) -> Path:
    """`revision`'s gat/csrc/fused.cpp built into `folder` (build_aside)."""
    shown = subprocess.run(["git", "show", f"{revision}:gat/csrc/fused.cpp"], cwd=REPO_ROOT, capture_output=True)
    if shown.returncode != 0:
        raise StageError(f"git has no gat/csrc/fused.cpp at {revision!r}: pass a commit of this repository "
                         "(e.g. `--against HEAD~1`)")
    source = folder / "fused.cpp"
    source.write_bytes(shown.stdout)
    return build_aside(source, folder / "fused.so", extra_flags, f"{revision}'s fused.cpp")


def turns(names: Sequence[str], round_: int) -> list[str]:
    """The order in which the kernels take their turns in round `round_`: as given in even rounds, reversed in odd
    ones (A B, B A, ...), so that a bias toward the first-timed (or the second-timed) turn falls on both alike."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def cora_protocol(cora: Graph) -> tuple[GraphTensors, Setup, NodeView, NodeView]:
    """Cora's tensors, the paper's protocol, and the training and validation nodes' 2-hop views."""
    graph = GraphTensors.from_graph(cora)
    train_view, val_view = (NodeView.of(graph, nodes, 2) for nodes in (graph.train_idx, graph.val_idx))
    return graph, protocol(), train_view, val_view


def warm_trainers(cora: Graph, libraries: dict[str, Any], seeds: int,
                  epochs: int) -> dict[str, tuple[fused.FusedTrainer, ReplicaDropout]]:
    """For each library, Cora's paper model of `seeds` seeds in a gat.fused.FusedTrainer and its dropout, after
    `epochs` epochs (a step and a validation pass each) to warm up: the workspaces allocated, the data in cache."""
    graph, paper, train_view, val_view = cora_protocol(cora)
    trainers = {}
    for name, lib in libraries.items():
        model = GAT(paper.model, graph.x.num_features, graph.num_classes, tuple(range(seeds)))
        trainer = fused.FusedTrainer(model, paper.optim.lr, paper.optim.weight_decay, train_view, val_view, lib=lib)
        trainers[name] = (trainer, ReplicaDropout(tuple(range(seeds)), paper.model.dropout))
    for trainer, noise in trainers.values():
        for _ in range(epochs):
            trainer.step(noise)
            trainer.validate()
    return trainers


def time_kernels(cora: Graph, libraries: dict[str, Any], seeds: int, rounds: int,
                 block: int) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per seed of a training step and of a validation pass, one sample per block, for each library."""
    trainers = warm_trainers(cora, libraries, seeds, block)
    samples: dict[str, dict[str, list[float]]] = {name: {"step": [], "validation": []} for name in libraries}
    for round_ in range(rounds):
        for name in turns(list(trainers), round_):
            trainer, noise = trainers[name]
            start = time.perf_counter()
            for _ in range(block):
                trainer.step(noise)
            middle = time.perf_counter()
            for _ in range(block):
                trainer.validate()
            end = time.perf_counter()
            samples[name]["step"].append((middle - start) / block / seeds * 1e3)
            samples[name]["validation"].append((end - middle) / block / seeds * 1e3)
    return samples


def time_native_loops(cora: Graph, libraries: dict[str, Any], seeds: int, rounds: int, block: int,
                      first_w_by_feature: dict[str, bool] | None = None) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per seed-epoch of the native loop (SeedLanes, lanes of 1, one thread: a tick is one epoch of
    every seed), one sample per block of `block` ticks, for each library. Early stopping's patience is the run's
    length, so every seed trains in every tick. `first_w_by_feature` gives a name's layout of the first W (SeedLanes'
    argument); a name without one takes the kernel's choice for this CPU."""
    layouts = first_w_by_feature or {}
    graph, paper, train_view, val_view = cora_protocol(cora)
    epochs = (rounds + 1) * block + 1
    loops = {}
    for name, lib in libraries.items():
        model = GAT(paper.model, graph.x.num_features, graph.num_classes, tuple(range(seeds)))
        noise = ReplicaDropout(tuple(range(seeds)), paper.model.dropout)
        try:
            loops[name] = fused.SeedLanes(model, paper.optim.lr, paper.optim.weight_decay, epochs, epochs,
                                          train_view, val_view, noise, lanes=1, threads=1, lib=lib,
                                          first_w_by_feature=layouts.get(name))
        except fused.FusedUnavailable as error:
            raise StageError(f"the kernel {name!r} has no native loop of lanes of 1 ({error}): compare it without "
                             "--native") from None
    try:
        for loop in loops.values():  # warm: the workspaces allocated, the data in cache
            for _ in range(block):
                loop.tick()
        samples: dict[str, dict[str, list[float]]] = {name: {"native loop's epoch": []} for name in libraries}
        for round_ in range(rounds):
            for name in turns(list(loops), round_):
                start = time.perf_counter()
                for _ in range(block):
                    loops[name].tick()
                samples[name]["native loop's epoch"].append((time.perf_counter() - start) / block / seeds * 1e3)
        return samples
    finally:
        for loop in loops.values():
            loop.close()


BY_FEATURE, TRANSPOSED = "first W by feature", "first W transposed"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compared = parser.add_mutually_exclusive_group(required=True)
    compared.add_argument("--against", help="the commit whose fused.cpp to compare with")
    compared.add_argument("--first-w-layouts", action="store_true",
                          help="this checkout's native loop with the first W by input feature against transposed in "
                               "every pass (implies --native)")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per call (a reproduce batch's)")
    parser.add_argument("--rounds", type=int, default=15, help="blocks per kernel, taking turns")
    parser.add_argument("--block", type=int, default=20, help="calls per block")
    parser.add_argument("--native", action="store_true",
                        help="time whole epochs of the native loop (SeedLanes, lanes of 1) instead of the step and "
                             "the validation pass between Python's calls")
    parser.add_argument("--extra-flags", default="",
                        help="compiler flags added to the older build's, e.g. --against HEAD "
                             "--extra-flags=-ffp-contract=fast: what contracting into FMAs would buy")
    args = parser.parse_args(argv)
    if args.first_w_layouts and args.extra_flags:
        parser.error("--extra-flags changes an older commit's build: use it with --against")
    extra_flags = tuple(shlex.split(args.extra_flags))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        current = fused.library()
        if args.first_w_layouts:
            names = [BY_FEATURE, TRANSPOSED]
            samples = time_native_loops(load_graph(default_data_dir()), dict.fromkeys(names, current), args.seeds,
                                        args.rounds, args.block, {BY_FEATURE: True, TRANSPOSED: False})
        else:
            names = ["this checkout", " ".join([args.against, *extra_flags])]
            with tempfile.TemporaryDirectory(prefix="gat-kernel-ab-") as folder:
                # The revision first: a wrong one is told at once, before the data is looked for.
                older = fused.load(build_revision(args.against, Path(folder), extra_flags), earlier=True)
                timing = time_native_loops if args.native else time_kernels
                samples = timing(load_graph(default_data_dir()), dict(zip(names, (current, older))), args.seeds,
                                 args.rounds, args.block)
    except (StageError, fused.FusedUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        torch.set_num_threads(threads)
    for what in samples[names[0]]:
        medians = {name: statistics.median(values[what]) for name, values in samples.items()}
        for name, values in samples.items():
            print(f"{what} ms per seed, {name}: {medians[name]:.3f} [{min(values[what]):.3f}-{max(values[what]):.3f}]")
        print(f"{what}: {names[0]} / {names[1]} = {medians[names[0]] / medians[names[1]]:.3f}")
    if args.first_w_layouts:
        chosen = BY_FEATURE if current.gat_first_w_by_feature() else TRANSPOSED
        print(f"the native loop runs with the {chosen} on this CPU (by its L2 cache's size per core)")


if __name__ == "__main__":
    main()
