"""The benchmark's JSON report and Markdown table: per-seed medians, ratios to PyG, targets, the machine."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Mapping, Sequence

import psutil
import torch

from benchmarks.data import DATASET, protocol
from benchmarks.timing import ATTENTION_VARIANTS, BURST, DEFAULT_THREADS, Case, Samples, percentile
from gat.data import Graph
from stages.support.seed_task import worker_facts

# What the engine is meant to achieve against the same run's PyG figures; reported, never adjusted.
TARGETS = {"train_step_vs_pyg": 0.10, "eval_vs_pyg": 0.25, "peak_rss_mb": 500.0}
# The fused kernel's (issue 12), on its one-seed row: the training step, and as `eval` the validation pass that
# train runs after every step; its seed-epochs per second in `train` (as a reproduce worker runs it) against
# the torch kernel's, measured in the same run.
FUSED_TARGETS = {"train_step_vs_pyg": 0.04, "eval_vs_pyg": 0.10, "peak_rss_mb": 500.0}
FUSED_SPEEDUP_TARGET = 3.0
# Issue 22's, on the native loop's row (what `reproduce` runs, per seed of a batch): the training step, and the
# validation pass that each epoch runs.
NATIVE_LOOP_TARGETS = {"train_step_vs_pyg": 0.012, "eval_vs_pyg": 0.035, "peak_rss_mb": 500.0}
# Issue 22: seed-epochs per CPU second against the fused kernel as issue 22 found it (its starting point's own code,
# benchmarks.throughput.ISSUE_22_START): of train, 4 seeds per batch, and of Cora's whole reproduce stage.
LANES_SPEEDUP_TARGET = 2.5
# Issue 22: Cora's whole reproduce stage (100 seeds, 2 workers) in at most this many seconds of wall time.
STAGE_WALL_TARGET_S = 40.0


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def summarise(case: Case, samples: Samples, peak: dict | None) -> dict:
    """One implementation's entry of the JSON report: per-seed medians, spread, repeats, threads, graph."""
    per_seed = 1.0 / case.replicas
    entry = {
        "label": case.label,
        "train_step_ms": percentile(samples.train_ms, 50) * per_seed,
        "eval_ms": percentile(samples.eval_ms, 50) * per_seed,
        "train_step_ms_p10": percentile(samples.train_ms, 10) * per_seed,
        "train_step_ms_p90": percentile(samples.train_ms, 90) * per_seed,
        "eval_ms_p10": percentile(samples.eval_ms, 10) * per_seed,
        "eval_ms_p90": percentile(samples.eval_ms, 90) * per_seed,
        "train_step_samples_ms": samples.train_ms,
        "eval_samples_ms": samples.eval_ms,
        "peak_rss_mb": None if peak is None else peak["peak_rss_mb"],
        "peak_rss_epochs": None if peak is None else peak["epochs"],
        "threads": case.threads,
        "replicas": case.replicas,
        "per_seed": case.replicas > 1,
        "warmup": case.warmup,
        "repeats": len(samples.train_ms),
        "graph": case.graph,
        "eval_scope": case.eval_scope,
        "last_train_loss": samples.train_loss,
        "last_val_loss": samples.val_loss,
    }
    if case.replicas > 1:
        entry["train_step_ms_whole_batch"] = percentile(samples.train_ms, 50)
        entry["eval_ms_whole_batch"] = percentile(samples.eval_ms, 50)
    return entry


def add_ratios(entries: dict[str, dict], listed: Sequence[Case]) -> str:
    """Ratios of every entry to the faster PyG case's medians (in place); returns that case's key.

    "Faster" is judged on the training step; entries on another graph than the reference's get no ratio.
    """
    references = [case for case in listed if case.reference]
    best = min(references, key=lambda case: entries[case.key]["train_step_ms"])
    reference = entries[best.key]
    for case in listed:
        entry = entries[case.key]
        for name in ("train_step", "eval"):
            ratio = _ratio(entry[f"{name}_ms"], reference[f"{name}_ms"])
            entry[f"{name}_vs_pyg"] = ratio if case.full_graph else None
    return best.key


def attention_variants(entries: Mapping[str, dict]) -> dict:
    """Each model.attention variant's per-step cost on this engine (1 seed, the torch kernel: the rows `engine`,
    `engine_gatv2`, `engine_constant`) as ratios to the same run's PyG GATConv and GATv2Conv, each PyG layer at its
    faster thread count on the training step."""
    def fastest(keys: list[str]) -> str:
        return min(keys, key=lambda key: entries[key]["train_step_ms"])

    gatv2conv = fastest([key for key in entries if key.startswith("pyg_gatv2_")])
    gatconv = fastest([key for key in entries if key.startswith("pyg_") and not key.startswith("pyg_gatv2_")])
    variants = {}
    for attention in ATTENTION_VARIANTS:
        entry = entries["engine" if attention == "gat" else f"engine_{attention}"]
        variants[attention] = {"train_step_ms": entry["train_step_ms"], "eval_ms": entry["eval_ms"]}
        for name, key in (("gatconv", gatconv), ("gatv2conv", gatv2conv)):
            for step in ("train_step", "eval"):
                variants[attention][f"{step}_vs_pyg_{name}"] = _ratio(entry[f"{step}_ms"], entries[key][f"{step}_ms"])
    return {"pyg_gatconv": gatconv, "pyg_gatv2conv": gatv2conv, "variants": variants}


def check_targets(engine: dict, targets: Mapping[str, float] = TARGETS) -> dict:
    """An entry's figures against `targets`: value, target and whether it is met (None when not measured)."""
    checks = {}
    for name, target in targets.items():
        value = engine.get(name)
        checks[name] = {"value": value, "target": target, "met": None if value is None else bool(value <= target)}
    return checks


def machine() -> dict:
    """Where the numbers come from."""
    import torch_geometric

    return {
        "cpu_model": worker_facts()["cpu_model"],
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_geometric": torch_geometric.__version__,
        "default_threads": DEFAULT_THREADS,
    }


def build_report(entries: dict[str, dict], reference_key: str, environment: dict, graph: Graph,
                 baseline_mb: float | None, extra: dict | None = None) -> dict:
    """The whole JSON document; `entries` are `summarise` outputs with ratios, keyed by case."""
    engine = entries.get("engine", {})
    model, optim = protocol().model, protocol().optim
    return {
        "dataset": {"name": DATASET, "nodes": graph.num_nodes, "features": graph.num_features,
                    "directed_edges_without_self_loops": int(graph.edge_index.shape[1]),
                    "classes": graph.num_classes, "train_nodes": int(graph.train_idx.numel()),
                    "val_nodes": int(graph.val_idx.numel())},
        "model": {"hidden_features": model.hidden_features, "heads": model.heads, "output_heads": model.output_heads,
                  "dropout": model.dropout, "leaky_relu_negative_slope": model.leaky_relu_negative_slope,
                  "optimiser": f"Adam(lr={optim.lr}, weight_decay={optim.weight_decay})"},
        "environment": environment,
        "method": {
            "clock": "time.perf_counter, per call, in milliseconds",
            "statistic": "median over the repeats; p10 and p90 alongside",
            "order": (f"warm-up calls per implementation, then the implementations take turns in one process; at each "
                      f"turn the engine and PyG make 1 untimed call (the others evicted their caches) and {BURST} "
                      "timed calls in a row, as a training loop does; the dense model makes 1 timed call"),
            "train_step": "model.train(), zero_grad, forward, loss, backward, optimiser step",
            "eval_pass": "model.eval(), forward without autograd, validation loss and accuracy",
            "per_seed": "rows with replicas > 1 report the time of one call divided by the replicas; "
                        "their peak RSS is the whole batch's process",
            "peak_rss": "VmHWM (peak resident set size) of a separate, fresh process per implementation "
                        "that loads Cora, builds the model and trains it peak_rss_epochs epochs "
                        "(training step + evaluation pass); MB = 2^20 bytes",
            "ratios": f"to the same run's {entries[reference_key]['label']}, the faster PyG case "
                      "on the training step; null where the graph differs",
        },
        "baseline_torch_import_rss_mb": baseline_mb,
        "engine_rss_above_baseline_mb": (None if baseline_mb is None or engine.get("peak_rss_mb") is None
                                         else engine["peak_rss_mb"] - baseline_mb),
        "reference": reference_key,
        "targets": check_targets(engine),
        "implementations": entries,
        **(extra or {}),
    }


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def format_table(report: dict) -> str:
    """The Markdown table and the lines that say where the numbers come from."""
    env = report["environment"]
    lines = [
        f"Device: {env['cpu_model']}, {env['logical_cores']} logical cores; torch {env['torch']}, "
        f"PyG {env['torch_geometric']}; load average {report.get('load_average_before')} before, "
        f"{report.get('load_average_after')} after; other processes used "
        f"{_fmt(report.get('other_processes_cpu_share_during_timing'), '.1%')} of the CPUs during the timed calls",
        "",
        "| implementation | threads | graph | train step ms | eval ms | peak RSS MB "
        "| train step vs PyG | eval vs PyG |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["implementations"].values():
        lines.append(
            f"| {entry['label']} | {entry['threads']} | {entry['graph']} | {_fmt(entry['train_step_ms'], '.2f')} "
            f"| {_fmt(entry['eval_ms'], '.2f')} | {_fmt(entry['peak_rss_mb'], '.0f')} "
            f"| {_fmt(entry['train_step_vs_pyg'], '.3f')} | {_fmt(entry['eval_vs_pyg'], '.3f')} |")
    lines += ["", f"Ratios are to {report['implementations'][report['reference']]['label']} (the faster PyG case). "
              f"Peak RSS: a fresh process per implementation; a process that only imports torch peaks at "
              f"{_fmt(report['baseline_torch_import_rss_mb'], '.0f')} MB."]
    for who, targets in (("engine", report["targets"]), ("fused kernel", report.get("fused_targets", {})),
                         ("native loop, per seed", report.get("native_loop_targets", {}))):
        for name, check in targets.items():
            verdict = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
            lines.append(f"Target {who} {name} <= {check['target']}: {_fmt(check['value'], '.3f')} ({verdict})")
    variants = report.get("attention_variants")
    if variants:
        names = {key: report["implementations"][variants[key]]["label"] for key in ("pyg_gatconv", "pyg_gatv2conv")}
        lines.append(f"Attention variants (this engine, 1 seed, torch kernel), train step / eval pass as ratios to "
                     f"{names['pyg_gatconv']} and to {names['pyg_gatv2conv']}:")
        for attention, row in variants["variants"].items():
            lines.append(f"- {attention}: {_fmt(row['train_step_ms'], '.2f')} / {_fmt(row['eval_ms'], '.2f')} ms; "
                         f"vs GATConv {_fmt(row['train_step_vs_pyg_gatconv'], '.3f')} / "
                         f"{_fmt(row['eval_vs_pyg_gatconv'], '.3f')}; vs GATv2Conv "
                         f"{_fmt(row['train_step_vs_pyg_gatv2conv'], '.3f')} / "
                         f"{_fmt(row['eval_vs_pyg_gatv2conv'], '.3f')}")
    curve = report.get("lane_curve")
    if curve:
        lines.append(f"Seed-epochs per CPU second of train, kernel fused ({curve['epochs']} epochs, 1 thread, median "
                     f"of {curve['rounds']}): " + "; ".join(f"{key}: {rate:.0f} ({curve['vs_reference'][key]:.2f}x)"
                                                        for key, rate in curve["seed_epochs_per_s"].items()))
        lines.append(f"Best native loop ({curve['best']}) against the {curve['reference']}: "
                     f"{curve['best_vs_reference']:.2f}x")
    start = report.get("against_issue_22_start")
    if start:
        rate, this = start["seed_epochs_per_s"], "this checkout"
        lines.append(f"Seed-epochs per CPU second of train ({start['seeds_per_batch']} seeds per batch, 1 thread, "
                     f"median of {start['rounds']} fresh processes each): this checkout {rate[this]:.0f}, issue 22's "
                     f"starting point {start['against'][:7]} {rate[start['against']]:.0f}: {start['speedup']:.2f}x; "
                     f"target >= {start['target']}x ({'met' if start['met'] else 'NOT met'}); "
                     f"{'the same' if start['same_weights'] else 'NOT the same'} weights")
    stage = report.get("stage_against_issue_22_start")
    if stage:
        rate, against = stage["seed_epochs_per_s"], stage["against"]
        lines.append(f"Seed-epochs per CPU second of Cora's whole reproduce stage (its worker processes included, "
                     f"median of {stage['rounds']} run(s) each): this checkout {rate['this checkout']:.0f}, issue 22's "
                     f"starting point {against[:7]} {rate[against]:.0f}: {stage['speedup']:.2f}x; target >= "
                     f"{stage['target']}x ({'met' if stage['met'] else 'NOT met'}); "
                     f"{'the same' if stage['same_seeds'] else 'NOT the same'} seeds.csv")
        lines.append(f"Cora's whole reproduce stage: {stage['wall_s']:.1f} s of wall time (issue 22's starting point "
                     f"{statistics.median(stage['wall_s_samples'][against]):.1f} s); target <= "
                     f"{stage['wall_target_s']:.0f} s ({'met' if stage['wall_met'] else 'NOT met'})")
    throughput = report.get("reproduce_throughput")
    if throughput:
        rate = throughput["seed_epochs_per_s"]
        lines.append(f"Seed-epochs per CPU second of train ({throughput['seeds_per_batch']} seeds per batch, "
                     f"1 thread): fused {rate['fused']:.0f}, torch {rate['torch']:.0f}: "
                     f"{throughput['fused_vs_torch']:.2f}x "
                     f"({throughput['fused_vs_torch_wall']:.2f}x in wall time); target >= {throughput['target']}x "
                     f"({'met' if throughput['met'] else 'NOT met'})")
    return "\n".join(lines)
