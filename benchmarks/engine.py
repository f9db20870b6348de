"""Time this engine against PyTorch Geometric's GATConv and the annotated tutorial's dense layer on Cora.

    python -m benchmarks.engine --out reports/benchmark.json      (what `make bench` runs)

Three implementations of the paper's Cora model (params.yaml's `reproduce.protocol.cora`: 8 heads x 8
features concatenated, ELU, one output head, dropout 0.6, Adam with lr 0.005 and L2 5e-4), each timed for

- a training step: forward, backward and optimiser step, as one epoch of training does it;
- an evaluation pass: a forward pass with dropout off, then the validation loss and accuracy.

The implementations:

- `engine`: `gat.model.GAT`, stepped by `gat.training.train_step`, the step of every epoch of
  `gat.training.train` (the loss on the training nodes' receptive field, `NodeView`), and
  evaluated by `gat.training.evaluate`, the evaluation of every stage (a whole-graph forward
  pass, then the validation and test loss and accuracy). One replica, and, as a second row,
  the cost per seed of a batch of seeds trained in one model (how the reproduce stage runs).
  One intra-op thread, as the pipeline runs it.
- `fused`, `fused_batched` and `fused_native`: the fused kernel, in the Python epoch loop (gat.fused.FusedTrainer,
  one seed, then per seed of a batch) and in the native loop that `reproduce` runs (gat.fused.SeedLanes: one call
  is one epoch of every seed, and the kernel's own clock splits it into the training steps and the validation
  passes). Issue 22's targets are checked on `fused_native`.
- `pyg`: `torch_geometric.nn.GATConv` in the architecture of PyG's `examples/gat.py`, on the
  whole graph with dense row-normalised features; at one and at two intra-op threads. The
  faster of the two is the reference the ratios are taken against.
- the attention variants: `engine_gatv2` and `engine_constant` are the `engine` row with `model.attention`
  gatv2 and constant (the torch kernel, which alone serves them), and `pyg_gatv2_<T>t` is the `pyg` model with
  `GATv2Conv` in place of `GATConv`; the report's `attention_variants` gives each variant's train step and eval
  pass as ratios to both PyG layers.
- `dense`: the tutorial's `GraphAttentionLayer` (gat/dense_reference.py), O(N²·H) memory;
  on the whole graph when its estimated peak fits in the available memory, else on an
  induced subgraph (the output says which).

Timings are wall clock (`time.perf_counter`) per call, after warm-up calls, with the
implementations' repetitions interleaved in one process so that a change in machine load
hits all of them alike; the report gives medians with the 10th and 90th percentiles. Peak
resident set size is per process and only grows, so each implementation's training is run
again in a fresh process of its own (`--peak-of KEY`), and a process that only imports torch
is measured as the baseline.

This module is the command line; benchmarks.data finds Cora and reads the protocol, benchmarks.implementations
builds the three implementations, benchmarks.timing times them and measures peaks, benchmarks.throughput
compares the kernels as a reproduce worker runs them and, with benchmarks.stage_ab, Cora's whole reproduce stage
with issue 22's starting point's (`--stage-rounds`), and benchmarks.report writes the JSON and the table.

The raw Cora files come from `--data-dir`; by default from ../shared/datasets/planetoid when
that folder exists, else from data/raw/cora, where `make repro` downloads them. They are checked
against the pinned SHA-256 list (gat/planetoid.sha256) either way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import psutil

from benchmarks.data import DOWNLOADED_DATA_DIR, REPO_ROOT, SHARED_DATA_DIR, default_data_dir, load_graph
from benchmarks.implementations import dense_node_count, dense_peak_bytes
from benchmarks.report import (FUSED_TARGETS, NATIVE_LOOP_TARGETS, add_ratios, attention_variants, build_report,
                               check_targets, format_table, machine, summarise)
from benchmarks.throughput import (against_issue_22_start, lane_curve, reproduce_throughput,
                                   stage_against_issue_22_start)
from benchmarks.timing import baseline_rss_mb, cases, measure, peak_of
from stages.support import interrupts
from stages.support.files import write_json


def peak_in_subprocess(key: str, args: argparse.Namespace) -> dict:
    """Run `--peak-of key` in a fresh interpreter: a process's peak RSS covers all it did, and never decreases."""
    command = [sys.executable, "-m", "benchmarks.engine", "--peak-of", key, "--data-dir", str(args.data_dir.resolve()),
               "--peak-epochs", str(args.peak_epochs), "--dense-nodes", str(args.dense_nodes),
               "--batched-seeds", str(args.batched_seeds)]
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the peak-RSS process for {key} failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "benchmark.json")
    parser.add_argument("--data-dir", type=Path,
                        help=f"folder with the raw ind.cora.* files (default: {SHARED_DATA_DIR} if it exists, "
                             f"else {DOWNLOADED_DATA_DIR}, from `make repro`)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls of the engine and PyG cases")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--dense-repeats", type=int, default=3, help="timed calls of the dense model (seconds each)")
    parser.add_argument("--dense-warmup", type=int, default=1)
    parser.add_argument("--batched-seeds", type=int, default=4, help="seeds per model in the batched engine row")
    parser.add_argument("--dense-nodes", type=int, default=0,
                        help="nodes of the dense model's graph; 0: all of Cora if it fits in memory, else fewer")
    parser.add_argument("--peak-epochs", type=int, default=20,
                        help="epochs each peak-RSS process trains (the dense model: 1, each costs seconds)")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--throughput-epochs", type=int, default=200,
                        help="epochs of each train() run that compares the kernels' seed-epochs/s; 0: skip it")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--lane-epochs", type=int, default=100,
                        help="epochs of each train() run of the lane curve (per-seed loop against seeds as lanes); "
                             "0: skip it")
    parser.add_argument("--start-epochs", type=int, default=300,
                        help="epochs of each train() run of the comparison with issue 22's starting point (its own "
                             "code, from git); 0: skip it")
    parser.add_argument("--stage-rounds", type=int, default=1,
                        help="runs per side of Cora's whole reproduce stage against issue 22's starting point (its own "
                             "code, from git; Cora prepared from --data-dir by the preprocess stage); 0: skip it")
    parser.add_argument("--no-verify", action="store_true", help="skip the checksum check of the raw files")
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)  # internal: one fresh process per implementation
    return parser.parse_args(argv)


def run_peak_child(args: argparse.Namespace) -> None:
    """`--peak-of KEY`: train one case and print its peak RSS as the last line of JSON."""
    graph = load_graph(args.data_dir, verify=False)  # the parent verified the files
    listed = {case.key: case for case in cases(graph, repeats=1, warmup=0, dense_repeats=1, dense_warmup=0,
                                                batched_seeds=args.batched_seeds, dense_nodes=args.dense_nodes)}
    epochs = 1 if args.peak_of == "dense" else args.peak_epochs
    print(json.dumps(peak_of(listed[args.peak_of], graph, epochs)))


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark: time, measure peaks, write the JSON, print the table."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    graph = load_graph(args.data_dir, verify=not args.no_verify)
    if args.dense_nodes <= 0:
        # Decided once, here, and passed on, so the dense model's timings and peak use the same graph.
        args.dense_nodes = dense_node_count(graph.num_nodes, psutil.virtual_memory().available)
    listed = cases(graph, repeats=args.repeats, warmup=args.warmup, dense_repeats=args.dense_repeats,
                   dense_warmup=args.dense_warmup, batched_seeds=args.batched_seeds, dense_nodes=args.dense_nodes)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731 - progress on stderr
    samples, others = measure(graph, listed, log)
    if others > 0.1:
        log(f"warning: other processes used {others:.0%} of the CPUs while the calls were timed")

    peaks, baseline = {}, None
    if not args.no_peak:
        baseline = baseline_rss_mb()
        for case in listed:
            log(f"peak RSS of {case.label} in a fresh process")
            peaks[case.key] = peak_in_subprocess(case.key, args)

    entries = {case.key: summarise(case, samples[case.key], peaks.get(case.key)) for case in listed}
    reference_key = add_ratios(entries, listed)
    throughput = None
    if args.throughput_epochs > 0:
        log(f"seed-epochs per second of train, fused and torch kernels, {args.throughput_rounds} rounds")
        throughput = reproduce_throughput(graph, args.batched_seeds, args.throughput_epochs, args.throughput_rounds)
    curve = None
    if args.lane_epochs > 0:
        log(f"seed-epochs per second, per-seed loop against seeds as lanes, {args.throughput_rounds} rounds")
        curve = lane_curve(graph, args.lane_epochs, args.throughput_rounds)
    start = None
    if args.start_epochs > 0:
        log(f"seed-epochs per second against issue 22's starting point, {args.throughput_rounds} rounds")
        start = against_issue_22_start(args.data_dir, not args.no_verify, args.batched_seeds, args.start_epochs,
                                       args.throughput_rounds)
    stage = None
    if args.stage_rounds > 0:
        log(f"seed-epochs per CPU second of Cora's whole reproduce stage against issue 22's starting point, "
            f"{args.stage_rounds} round(s)")
        stage = stage_against_issue_22_start(args.data_dir, args.stage_rounds)
    extra = {"command": " ".join(["python", "-m", "benchmarks.engine", *args.argv]),
             "fused_targets": check_targets(entries["fused"], FUSED_TARGETS),
             "fused_batched_targets": check_targets(entries["fused_batched"], FUSED_TARGETS),
             "native_loop_targets": check_targets(entries["fused_native"], NATIVE_LOOP_TARGETS),
             "attention_variants": attention_variants(entries),
             "reproduce_throughput": throughput,
             "lane_curve": curve,
             "against_issue_22_start": start,
             "stage_against_issue_22_start": stage,
             "other_processes_cpu_share_during_timing": others,
             "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
             "dense_estimated_peak_gb": dense_peak_bytes(args.dense_nodes) / 2**30,
             "total_wall_s": time.perf_counter() - started}
    report = build_report(entries, reference_key, machine(), graph, baseline, extra)
    write_json(args.out, report)  # atomically: a crash never leaves half a report
    print(format_table(report))
    print(f"\nwritten: {args.out}")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the report's `command`

    def benchmark() -> None:
        if args.data_dir is None:
            args.data_dir = default_data_dir()
        run_peak_child(args) if args.peak_of else run(args)

    # An error: one line, exit 2. SIGTERM, Ctrl-C or a dead parent: one line; the running child process (a peak-RSS
    # process, a kernel's measuring process, a reproduce stage) is killed and the temporary folders removed; the
    # report is written only at the end, atomically. The PyG rows set their own thread counts (1 and 2).
    interrupts.main(benchmark, stopping="stopping; the running child process is killed, the temporary folders removed "
                                        "and no report written.", one_thread=False)


if __name__ == "__main__":
    main()
