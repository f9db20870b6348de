"""Train `reproduce.seeds` independent seeds on one dataset with the train stage's protocol.

    python -m stages.reproduce --dataset cora --data data/prepared/cora --out data/reproduce/cora

Writes `seeds.csv` (one row per seed), `histogram.csv` (per-seed test accuracy, for `dvc plots`)
and `summary.json` (mean, std, range, 95% CI, epochs; read by stages.report). MLflow gets one
parent run with the summary, the report section and the histogram, and one child run per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import mlflow
import torch
from tqdm import tqdm

from gat.config import Setup, flatten
from gat.data import graph_from_tensors, graph_to_tensors
from gat.reproduction import PAPER, histogram, summarise
from gat.training import EpochMetrics, GraphTensors, evaluate, train
from stages._common import (device_for, fail, load_params, load_prepared, main, outputs_together, write_csv,
                            write_json)
from stages._tracking import NOTE, REPRODUCE_EXPERIMENT, describe_run, log_child_runs, stage_run, standard_tags
from stages._report import dataset_section, histogram_figure
from stages._workers import worker_pool


def _train_seeds(graph_tensors, setup: Setup, seeds, device) -> tuple[list[dict], dict[int, tuple[float, float]]]:
    """One batch of seeds, in a worker process: train, restore, evaluate.

    Returns the per-seed rows and each seed's wall-clock (start, end) of training, kept apart from the rows
    so that seeds.csv holds only what the params determine.
    """
    torch.set_num_threads(1)  # one process per core (see stages._common.main)
    tensors = GraphTensors.from_graph(graph_from_tensors(graph_tensors), device)
    started = time.time()
    last_epoch_at = {seed: started for seed in seeds}

    def on_epoch(m: EpochMetrics) -> None:
        now = time.time()
        last_epoch_at.update((seed, now) for seed in m.seeds)

    result = train(tensors, setup.model, setup.optim, seeds, on_epoch)
    scores = evaluate(result.model, tensors)
    rows = [{"seed": seed, "test_acc": float(scores.test_acc[r]), "val_acc": float(scores.val_acc[r]),
             "epochs": int(result.epochs[r]), "best_epoch": int(result.best_epoch[r])}
            for r, seed in enumerate(result.seeds)]
    return rows, {seed: (started, last_epoch_at[seed]) for seed in result.seeds}


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.reproduce
    if args.dataset not in settings.protocol:
        fail(f"`reproduce.protocol.{args.dataset}` is missing from params.yaml: add the dataset's "
             "{model, optim} block (see the README's Parameters section).")
    setup = settings.protocol[args.dataset]
    device = device_for(settings.device, "reproduce.device")
    graph, meta = load_prepared(args.data, args.dataset)
    # One GPU serves one process; on CPU, one single-threaded process per core.
    workers = 1 if device.type == "cuda" else (settings.workers or os.cpu_count() or 1)
    seeds = list(range(settings.first_seed, settings.first_seed + settings.seeds))
    batches = [seeds[i:i + settings.seeds_per_batch] for i in range(0, len(seeds), settings.seeds_per_batch)]

    # params.yaml's dotted keys only: the settings of this reproduction and this dataset's protocol.
    logged = {**flatten({k: v for k, v in vars(settings).items() if k != "protocol"}, "reproduce"),
              **flatten(setup, f"reproduce.protocol.{args.dataset}")}
    tags = standard_tags(args.dataset, meta["source_sha256"])
    parent_tags = {**tags, "workers_resolved": str(workers), NOTE: describe_run(
        f"{len(seeds)} independent seeds of GAT on {args.dataset} (seeds {seeds[0]} to {seeds[-1]}), the paper's "
        "protocol: the metrics are the mean, std, range and 95% CI over the seeds; one child run per seed.", logged)}
    with stage_run(REPRODUCE_EXPERIMENT, f"{args.dataset}-{len(seeds)}-seeds", parent_tags) as parent:
        mlflow.log_params(logged)
        rows: list[dict] = []
        timings: dict[int, tuple[float, float]] = {}
        # Workers die with the stage, and are killed at once on SIGTERM, Ctrl-C or an error (stages._workers).
        with worker_pool(workers) as pool, \
                tqdm(total=len(seeds), desc=f"reproduce {args.dataset}", unit="seed", disable=None) as bar:
            # Plain tensors travel to the workers; torch's pickling of sparse ones warns on every batch.
            plain = graph_to_tensors(graph)
            jobs = [(plain, setup, batch, device) for batch in batches]
            for batch_rows, batch_timings in pool.map(_train_seeds, *zip(*jobs)):
                rows += batch_rows
                timings |= batch_timings
                bar.update(len(batch_rows))

        summary = {"dataset": args.dataset, "seeds": len(rows),
                   "test": vars(summarise([r["test_acc"] for r in rows])),
                   "val": vars(summarise([r["val_acc"] for r in rows])),
                   "epochs": vars(summarise([r["epochs"] for r in rows])),
                   "paper": vars(PAPER[args.dataset]),
                   "protocol": dataclasses.asdict(setup)}
        summary["inside_paper_band"] = PAPER[args.dataset].contains(summary["test"]["mean"])
        counts = histogram([r["test_acc"] for r in rows])
        bins = [{"test_acc_bin": f"{low:.3f}-{high:.3f}", "seeds": count} for low, high, count in counts]
        mlflow.log_metrics({f"{split}_acc_{key}": summary[split][key] for split in ("test", "val")
                            for key in ("mean", "std", "min", "max", "ci_low", "ci_high")}
                           | {"epochs_mean": summary["epochs"]["mean"], "seeds": len(rows)})
        mlflow.log_text(dataset_section(summary), "report.md")
        mlflow.log_figure(histogram_figure(rows, counts, summary), "test_acc_histogram.png")
        log_child_runs(parent.info.run_id, parent.info.experiment_id, args.dataset, rows, timings, tags)
        with outputs_together():
            write_csv(args.out / "seeds.csv", rows)
            write_csv(args.out / "histogram.csv", bins)
            write_json(args.out / "summary.json", summary)
    print(f"{args.dataset}: test accuracy {summary['test']['mean']:.4f} ± {summary['test']['std']:.4f} over "
          f"{len(rows)} seeds (paper {PAPER[args.dataset].mean:.3f} ± {PAPER[args.dataset].std:.3f}) -> {args.out}")


if __name__ == "__main__":
    main(run)
