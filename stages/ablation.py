"""Does attention matter? Every attention variant on the same seeds of each dataset, compared with the paper's.

    python -m stages.ablation [--data data/prepared] [--cache data/ablation] [--report reports/ablation.md]
                              [--plot reports/ablation.png]           (make ablation)

Not a DVC stage (it takes tens of minutes, and `make repro` must not): it reads the preprocessed datasets that
`make repro` made. For each dataset of `ablation.datasets` and variant of `ablation.variants` (a cell), it trains
`ablation.seeds` seeds with the dataset's `reproduce.protocol` block, `model.attention` replaced, as the reproduce
stage trains them (its executor, workers and batches: stages.support.seed_pool). Then it writes

- `reports/ablation.md`: per dataset and variant, the test accuracy's mean ± std and 95% CI, and the difference
  to `gat` paired by seed (a t interval of the per-seed differences) with how many seeds the variant beat `gat`
  on; the command, the machine, the commit, the date and the wall time that made it;
- `reports/ablation.png`: the same, drawn.

Each cell's per-seed results are cached in `<cache>/<dataset>/<variant>/seeds.csv` beside `fingerprint.json`
(the dataset's files, the cell's setup, the training code and kernel): a cell whose fingerprint matches
trains only the seeds it lacks, so an interrupted or repeated run only trains what is missing or changed.
MLflow's `gat-repro-ablation` experiment gets one run per invocation (the report and picture), under it one
per cell (its summary), under each one per seed.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import mlflow

from gat.data import Graph, graph_to_tensors
from gat.model import GAT
from gat.seeds import batches
from gat.training import planned_kernel
from stages.support.ablation_cache import Cell, fingerprint_of, read_cache, record_job, variant_setup
from stages.support.ablation_report import made_by, outcomes, report
from stages.support.ablation_runs import invocation_tags, log_cell
from stages.support.figures import ablation_figure, png_bytes
from stages.support.files import load_prepared, outputs_together, write_atomic
from stages.support.interrupts import main
from stages.support.local_pool import WorkerPool
from stages.support.params import ArgumentParser, device_for, fail, load_params, repo_root
from stages.support.progress import Progress
from stages.support.seed_pool import check_same_code, gather, starting_pool
from stages.support.seed_task import code_sha256
from stages.support.store import ABLATION_EXPERIMENT, compare_url, is_server, shown_uri, tracking_uri, ui_url
from stages.support.tracking import git_commit, logged_params, stage_run

# `make ui`'s address (tools.ui.DEFAULT_PORT): the pages to open once it runs.
LOCAL_UI = "http://127.0.0.1:5000"


def check_trainable(cell: Cell, graph: Graph) -> None:
    """Refuse, before any work, a variant that this checkout can't build."""
    try:
        GAT(cell.setup.model, graph.num_features, graph.num_classes, [0])
    except ValueError as error:
        fail(f"`ablation.variants`: {cell.variant!r} can't be trained by this checkout ({error}); drop it from "
             "the list, or update the checkout.")


def run() -> None:
    started = time.monotonic()
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("data/prepared"),
                        help="the folder of the preprocess stage's outputs, one subfolder per dataset")
    parser.add_argument("--cache", type=Path, default=Path("data/ablation"))
    parser.add_argument("--report", type=Path, default=Path("reports/ablation.md"))
    parser.add_argument("--plot", type=Path, default=Path("reports/ablation.png"))
    args = parser.parse_args()
    params = load_params()
    settings, executor = params.ablation, params.reproduce
    device = device_for(executor.device, "reproduce.device")
    # Every input before any work: a missing dataset is one line naming the stage that makes it.
    prepared = {dataset: load_prepared(args.data / dataset, dataset) for dataset in settings.datasets}
    code_sha256()  # the training code as this run starts, which every worker must run too (check_same_code)
    seeds = list(range(settings.first_seed, settings.first_seed + settings.seeds))
    cells: list[Cell] = []
    for dataset, (graph, meta) in prepared.items():
        for variant in settings.variants:
            setup = variant_setup(executor.protocol[dataset], variant)
            kernel = planned_kernel(setup.model, setup.optim, graph.num_classes, device)
            cell = Cell(dataset, variant, setup, kernel, args.cache / dataset / variant,
                        fingerprint_of(dataset, meta["source_sha256"], setup, kernel))
            check_trainable(cell, graph)
            cell.rows, stale = read_cache(cell.folder, cell.fingerprint["fingerprint"])
            if stale:
                print(f"ablation {dataset} {variant}: {stale}", file=sys.stderr)
            cells.append(cell)
    missing = {id(cell): [seed for seed in seeds if seed not in cell.rows] for cell in cells}

    logged = logged_params(params, "ablation")
    commit = git_commit(repo_root())  # the code's, wherever it runs from
    parent_tags = invocation_tags(settings, executor, seeds, commit, logged)
    with starting_pool(executor.executor, executor.workers, device, start_now=any(missing.values())) \
            as pool_when_ready, \
            stage_run(ABLATION_EXPERIMENT, f"ablation-{len(seeds)}-seeds", parent_tags) as parent:
        mlflow.log_params(logged)
        if any(missing.values()):
            # Workers start (as the MLflow run opens) only when something is left to train; a stop kills them and
            # ends the run FAILED, with the batches finished so far in the cache.
            with pool_when_ready() as pool:
                mlflow.set_tag("workers_resolved", str(pool.size))
                if not isinstance(pool, WorkerPool):
                    print(f"ablation: on {pool.describe()}", file=sys.stderr)
                    check_same_code(pool.run_on_workers(code_sha256))
                    mlflow.set_tag("dask_scheduler", pool.address)
                for dataset, (graph, _meta) in prepared.items():
                    # Every variant's batches of a dataset at once, so that no worker waits for a cell to end; whole
                    # batches (workers=1): the grid's last round ends the stage, not a cell's.
                    work = [(cell, batch) for cell in cells if cell.dataset == dataset
                            for batch in batches(missing[id(cell)], executor.seeds_per_batch)]
                    if not work:
                        continue
                    with Progress(f"ablation {dataset}", "seeds", total=sum(len(b) for _, b in work)) as bar:
                        gather(pool, graph_to_tensors(graph), [(cell.setup, batch) for cell, batch in work], device,
                               bar, functools.partial(record_job, work))
        found = outcomes(cells, seeds)
        trained = sum(cell.trained for cell in cells)
        mlflow.set_tags({"training_kernels": ",".join(sorted({cell.kernel for cell in cells})),
                         "seeds_trained_now": str(trained)})
        cell_runs = [log_cell(outcome, seeds, prepared[outcome.cell.dataset][1], parent.info.experiment_id)
                     for outcome in found]
        facts = made_by(started, commit, trained, len(seeds) * len(cells), logged)
        table = report(found, facts)
        picture = ablation_figure(found)
        mlflow.log_text(table, "ablation.md")
        mlflow.log_figure(picture, "ablation.png")
        mlflow.log_dict({"seeds": seeds, "cells": [{"dataset": o.cell.dataset, "variant": o.cell.variant,
                                                    "training_kernel": o.cell.kernel, **o.metrics()} for o in found]},
                        "ablation.json")
        with outputs_together():
            write_atomic(args.report, table)
            write_atomic(args.plot, png_bytes(picture))
    base = shown_uri().rstrip("/") if is_server(tracking_uri()) else LOCAL_UI
    where = "" if is_server(tracking_uri()) else " (with `make ui` running)"
    print(table, end="")
    print(f"\n{len(cells)} cells of {len(seeds)} seeds ({trained} trained now) -> {args.report}, {args.plot}; "
          f"MLflow store {shown_uri()}{where}:\n"
          f"  the cells side by side: {compare_url(base, cell_runs, [parent.info.experiment_id])}\n"
          f"  the ablation's runs: {ui_url(base, parent.info.experiment_id)}")


if __name__ == "__main__":
    main(run)
