"""Train `reproduce.seeds` independent seeds on one dataset with the train stage's protocol.

    python -m stages.reproduce --dataset cora --data data/prepared/cora --out data/reproduce/cora

Writes `seeds.csv` (one row per seed, with the SHA-256 of its restored weights), `histogram.csv`
(per-seed test accuracy, for `dvc plots`) and `summary.json` (mean, std, range, 95% CI, epochs; read by
stages.report). MLflow gets one parent run with the summary, the report section and the histogram, and
one child run per seed, tagged with where it ran, logged as its batch comes in: a stopped stage's parent run
is FAILED, with the seeds it finished.

The batches of seeds run on `reproduce.executor`: `local` worker processes (stages.support.local_pool) or a Dask
cluster (stages.support.dask_pool). Either way a batch is one pure task
(stages.support.seed_task.train_seed_batch, gathered by stages.support.seed_pool) and only this
process logs: the outputs are byte-identical whichever way, and wherever, it ran.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import mlflow

from gat.data import graph_to_tensors
from gat.datasets import DATASETS
from gat.reproduction import correct_answers, histogram, summarise
from gat.seeds import BatchResult, batches
from stages.support.files import load_prepared, outputs_together, write_csv, write_json
from stages.support.interrupts import main
from stages.support.local_pool import WorkerPool
from stages.support.params import ArgumentParser, device_for, fail, load_params
from stages.support.progress import Progress
from stages.support.seed_pool import check_same_code, gather, starting_pool
from stages.support.seed_task import code_sha256
from stages.support.store import NOTE, REPRODUCE_EXPERIMENT
from stages.support.tables import dataset_section, histogram_bins, histogram_figure, metrics
from stages.support.tracking import (describe_run, log_child_runs, logged_params, split_seed, stage_run,
                                     standard_tags)

def log_batch(parent: mlflow.ActiveRun, dataset: str, tags: dict[str, str], batch: list[int],
              result: BatchResult) -> None:
    """A batch's child runs as it comes in, while the workers train the others: logging 100 children at the end kept
    the finished results from the user for 1.6 s (SQLite) to 22 s (a team server)."""
    check_same_code([result])
    returned = [row["seed"] for row in result.rows]
    if returned != batch:
        fail(f"a worker returned seeds {returned} for the batch {batch}: a bug, please report it.")
    # Each seed's training time, inside the parent's (another host's clock may be off a little).
    start_s, now = parent.info.start_time / 1000, time.time()
    timings = {seed: (min(max(start, start_s), now), min(max(end, start_s), now))
               for seed, (start, end) in result.timings.items()}
    log_child_runs(parent.info.run_id, parent.info.experiment_id, dataset, result.rows, timings, tags,
                   {seed: result.worker for seed in returned})


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.reproduce
    if args.dataset not in settings.protocol:
        fail(f"`reproduce.protocol.{args.dataset}` is missing from params.yaml: add the dataset's "
             "{model, optim} block (see the README's \"Changing parameters and rerunning\").")
    setup = settings.protocol[args.dataset]
    device = device_for(settings.device, "reproduce.device")
    graph, meta = load_prepared(args.data, args.dataset)
    code_sha256()  # the training code as this run starts, which every worker must run too (check_same_code)
    seeds = list(range(settings.first_seed, settings.first_seed + settings.seeds))

    logged = logged_params(params, "reproduce", args.dataset)  # this reproduction's settings and protocol
    tags = standard_tags(args.dataset, meta["source_sha256"], split_seed(meta))
    parent_tags = {**tags, "executor": settings.executor, NOTE: describe_run(
        f"{len(seeds)} independent seeds of GAT on {args.dataset} (seeds {seeds[0]} to {seeds[-1]}), the paper's "
        "protocol: the metrics are the mean, std, range and 95% CI over the seeds; one child run per seed.", logged)}
    # A LocalCluster starts now, while MLflow opens the run.
    with starting_pool(settings.executor, settings.workers, device) as pool_when_ready, \
            stage_run(REPRODUCE_EXPERIMENT, f"{args.dataset}-{len(seeds)}-seeds", parent_tags) as parent:
        mlflow.log_params(logged)
        # Local workers die with the stage and are killed at once on SIGTERM, Ctrl-C or an error
        # (stages.support.local_pool); Dask tasks are cancelled then, and stop within an epoch
        # (stages.support.dask_pool). Inside the run: a scheduler
        # that can't be reached, or a cluster that fails to start, ends it FAILED.
        with pool_when_ready() as pool, \
                Progress(f"reproduce {args.dataset}", "seeds", total=len(seeds)) as progress:
            run_tags = {"workers_resolved": str(pool.size)}
            if not isinstance(pool, WorkerPool):
                progress.write(f"reproduce {args.dataset}: on {pool.describe()}")  # above the bar
                check_same_code(pool.run_on_workers(code_sha256))
                run_tags["dask_scheduler"] = pool.address
            mlflow.set_tags(run_tags)
            # Plain tensors travel to the workers; torch's pickling of sparse ones warns on every batch.
            # The last round in ever smaller batches, so that the workers end together (gat.seeds.batches).
            jobs = [(setup, batch) for batch in batches(seeds, settings.seeds_per_batch, pool.size)]
            results = gather(pool, graph_to_tensors(graph), jobs, device, progress,
                             on_result=lambda index, result: log_batch(parent, args.dataset, tags, jobs[index][1],
                                                                       result))
        rows = [row for result in results for row in result.rows]
        workers = [result.worker for result in results]
        mlflow.set_tags({"worker_hosts": ",".join(sorted({facts["worker_host"] for facts in workers})),
                         "training_kernels": ",".join(sorted({facts["training_kernel"] for facts in workers}))})

        # An npz graph has no published GAT result to compare with.
        paper = DATASETS[args.dataset].paper if args.dataset in DATASETS else None
        summary = {"dataset": args.dataset, "seeds": len(rows),
                   "test": vars(summarise([r["test_acc"] for r in rows])),
                   "val": vars(summarise([r["val_acc"] for r in rows])),
                   "epochs": vars(summarise([r["epochs"] for r in rows])),
                   "paper": None if paper is None else vars(paper),
                   "protocol": dataclasses.asdict(setup)}
        summary["inside_paper_band"] = None if paper is None else paper.contains(summary["test"]["mean"])
        # One set of bins, counted exactly on the correct answers out of the test nodes: histogram.csv, the
        # summary and the MLflow picture all show these.
        test_nodes = int(graph.test_idx.numel())
        bins = histogram_bins(histogram(correct_answers([r["test_acc"] for r in rows], test_nodes), test_nodes))
        summary["test_histogram"] = {"test_nodes": test_nodes, "bins": bins}
        # The names reports/reproduction.json gives them (test_acc_ci95_low, ...): one name per metric.
        flat = metrics(summary)
        # test_acc_mean first: MLflow's Compare page opens its parallel-coordinates plot on a run's first metric.
        summed = [name for name in flat
                  if name.startswith(("test_acc_", "val_acc_")) or name in ("epochs_mean", "seeds")]
        mlflow.log_metrics({name: flat[name] for name in sorted(summed, key=lambda name: name != "test_acc_mean")})
        mlflow.log_text(dataset_section(summary), "report.md")
        mlflow.log_figure(histogram_figure(bins, summary), "test_acc_histogram.png")
        with outputs_together():
            write_csv(args.out / "seeds.csv", rows)
            write_csv(args.out / "histogram.csv", bins)
            write_json(args.out / "summary.json", summary)
    published = "no published result" if paper is None else f"paper {paper.mean:.3f} ± {paper.std:.3f}"
    print(f"{args.dataset}: test accuracy {summary['test']['mean']:.4f} ± {summary['test']['std']:.4f} over "
          f"{len(rows)} seeds ({published}), "
          f"95% CI [{summary['test']['ci_low']:.4f}, {summary['test']['ci_high']:.4f}] -> {args.out}")


if __name__ == "__main__":
    main(run)
