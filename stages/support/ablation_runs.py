"""The ablation's MLflow runs: the invocation's tags, and under it one run per cell (its summary) with one run per
seed under that."""

from __future__ import annotations

from typing import Any, Sequence

import mlflow

from gat.config import AblationParams, ReproduceParams, flatten
from stages.support.ablation_cache import RESULT_COLUMNS
from stages.support.ablation_report import Outcome
from stages.support.store import ABLATION_EXPERIMENT, ABLATION_LEVEL, NOTE
from stages.support.tracking import describe_run, log_child_runs, stage_run, standard_tags


def invocation_tags(settings: AblationParams, executor: ReproduceParams, seeds: Sequence[int], commit: str,
                    logged: dict[str, Any]) -> dict[str, str]:
    """The tags of the invocation's run: the commit, the cells and seeds, and a note naming what it holds."""
    return {"git_commit": commit, "mlflow.source.git.commit": commit, ABLATION_LEVEL: "invocation",
            "datasets": ",".join(settings.datasets), "variants": ",".join(settings.variants),
            "executor": executor.executor, NOTE: describe_run(
                f"The attention ablation: {', '.join(settings.variants)} on {', '.join(settings.datasets)}, "
                f"seeds {seeds[0]} to {seeds[-1]} each; the report and its picture are this run's artifacts, "
                "one child run per dataset and variant.", logged)}


def log_cell(outcome: Outcome, seeds: Sequence[int], meta: dict[str, Any], experiment_id: str) -> str:
    """The cell's run under the invocation's, with its summary, and one run per seed under it; its run id."""
    cell = outcome.cell
    tags = {**standard_tags(cell.dataset, meta["source_sha256"]), "dvc_stage": "(not a DVC stage: make ablation)",
            "variant": cell.variant, "training_kernel": cell.kernel}
    with stage_run(ABLATION_EXPERIMENT, f"{cell.dataset}-{cell.variant}", {
            **tags, ABLATION_LEVEL: "cell", "cached": f"{len(seeds) - cell.trained}/{len(seeds)} seeds",
            NOTE: f"`{cell.variant}` attention on {cell.dataset}, {len(seeds)} seeds: the test accuracy's mean, "
                  "std and 95% CI, and the difference to gat paired by seed; one child run per seed."},
                   nested=True) as run:
        mlflow.log_params(flatten(cell.setup))
        mlflow.log_metrics(outcome.metrics())
        rows = [{key: cell.rows[seed][key] for key in RESULT_COLUMNS} for seed in seeds]
        timings = {seed: (cell.rows[seed]["started"], cell.rows[seed]["ended"]) for seed in seeds}
        where = {seed: {key: str(cell.rows[seed][key]) for key in ("worker_host", "training_kernel")} for seed in seeds}
        log_child_runs(run.info.run_id, experiment_id, f"{cell.dataset}-{cell.variant}", rows, timings,
                       {**tags, ABLATION_LEVEL: "seed"}, where)
        return run.info.run_id
