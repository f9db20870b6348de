"""Train `reproduce.seeds` independent seeds on one dataset with the train stage's protocol.

    python -m stages.reproduce --dataset cora --data data/prepared/cora --out data/reproduce/cora

Writes `seeds.csv` (one row per seed), `histogram.csv` (per-seed test accuracy, for `dvc plots`)
and `summary.json` (mean, std, range, 95% CI, epochs; read by stages.report). MLflow gets one
parent run with the summary, the report section and the histogram, and one child run per seed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
from pathlib import Path

import mlflow
import torch
from tqdm import tqdm

from gat.config import flatten
from gat.data import graph_from_tensors, graph_to_tensors
from gat.reproduction import PAPER, histogram, summarise
from gat.training import GraphTensors, loss_and_accuracy, predict, resolve_device, train
from stages._common import fail, load_params, load_prepared, main, write_csv, write_json
from stages._tracking import REPRODUCE_EXPERIMENT, log_child_runs, stage_run, standard_tags
from stages._report import dataset_section, histogram_figure


def _train_seeds(graph_tensors, model_config, optim, seeds, device) -> list[dict]:
    """One batch of seeds, in a worker process: train, restore, evaluate."""
    torch.set_num_threads(1)  # one process per core (see stages._common.main)
    tensors = GraphTensors.from_graph(graph_from_tensors(graph_tensors), device)
    result = train(tensors, model_config, optim, seeds)
    logits = predict(result.model, tensors)
    _, test_acc = loss_and_accuracy(logits, tensors.labels, tensors.test_idx)
    _, val_acc = loss_and_accuracy(logits, tensors.labels, tensors.val_idx)
    return [{"seed": seed, "test_acc": float(test_acc[r]), "val_acc": float(val_acc[r]),
             "epochs": int(result.epochs[r]), "best_epoch": int(result.best_epoch[r])}
            for r, seed in enumerate(result.seeds)]


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.reproduce
    if args.dataset not in settings.hyperparameters:
        fail(f"`reproduce.hyperparameters.{args.dataset}` is missing from params.yaml: add the dataset's "
             "lr, weight_decay, max_epochs and patience.")
    optim = settings.hyperparameters[args.dataset]
    graph, meta = load_prepared(args.data, args.dataset)
    device = resolve_device(settings.device)
    # One GPU serves one process; on CPU, one single-threaded process per core.
    workers = 1 if device.type == "cuda" else (settings.workers or os.cpu_count() or 1)
    seeds = list(range(settings.first_seed, settings.first_seed + settings.seeds))
    batches = [seeds[i:i + settings.seeds_per_batch] for i in range(0, len(seeds), settings.seeds_per_batch)]

    tags = standard_tags(args.dataset, meta["source_sha256"])
    with stage_run(REPRODUCE_EXPERIMENT, f"{args.dataset}-{len(seeds)}-seeds", tags) as parent:
        mlflow.log_params({"dataset": args.dataset, "workers": workers, **flatten(params.model, "model"),
                           **flatten({k: v for k, v in vars(settings).items() if k != "hyperparameters"},
                                     "reproduce"), **flatten(optim, f"reproduce.hyperparameters.{args.dataset}")})
        rows: list[dict] = []
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool, \
                tqdm(total=len(seeds), desc=f"reproduce {args.dataset}", unit="seed", disable=None) as bar:
            # Plain tensors travel to the workers; torch's pickling of sparse ones warns on every batch.
            plain = graph_to_tensors(graph)
            jobs = [(plain, params.model, optim, batch, device) for batch in batches]
            for batch_rows in pool.map(_train_seeds, *zip(*jobs)):
                rows += batch_rows
                bar.update(len(batch_rows))

        summary = {"dataset": args.dataset, "seeds": len(rows),
                   "test": vars(summarise([r["test_acc"] for r in rows])),
                   "val": vars(summarise([r["val_acc"] for r in rows])),
                   "epochs": vars(summarise([r["epochs"] for r in rows])),
                   "paper": vars(PAPER[args.dataset])}
        summary["inside_paper_band"] = PAPER[args.dataset].contains(summary["test"]["mean"])
        counts = histogram([r["test_acc"] for r in rows])
        bins = [{"test_acc_bin": f"{low:.3f}-{high:.3f}", "seeds": count} for low, high, count in counts]
        mlflow.log_metrics({f"{split}_acc_{key}": summary[split][key] for split in ("test", "val")
                            for key in ("mean", "std", "min", "max", "ci_low", "ci_high")}
                           | {"epochs_mean": summary["epochs"]["mean"], "seeds": len(rows)})
        mlflow.log_text(dataset_section(summary), "report.md")
        mlflow.log_figure(histogram_figure(rows, counts, summary), "test_acc_histogram.png")
        log_child_runs(parent.info.run_id, parent.info.experiment_id, rows, tags)
        write_csv(args.out / "seeds.csv", rows)
        write_csv(args.out / "histogram.csv", bins)
        write_json(args.out / "summary.json", summary)
    print(f"{args.dataset}: test accuracy {summary['test']['mean']:.4f} ± {summary['test']['std']:.4f} over "
          f"{len(rows)} seeds (paper {PAPER[args.dataset].mean:.3f} ± {PAPER[args.dataset].std:.3f}) -> {args.out}")


if __name__ == "__main__":
    main(run)
