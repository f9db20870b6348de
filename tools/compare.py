"""Compare every reproduced configuration: mean test accuracy with its 95% CI, per dataset.

    python -m tools.compare [--exp NAME ...] [--markdown reports/compare.md] [--plot reports/compare.png]

An ablation is DVC experiments (`dvc exp run --queue -S ...`, one per configuration) whose reproduce
stages each log a parent run to MLflow's `gat-repro-reproduce` experiment. This reads those parents
(FINISHED ones; with `--exp`, only those of the named DVC experiments), keeps the newest run of each
(dataset, configuration), and writes

- a Markdown table: per dataset, best first, each configuration's seeds, mean ± std and 95% CI of the
  test accuracy, the DVC experiment and the MLflow run it came from;
- a plot: per dataset, each configuration's mean test accuracy with its 95% CI as an error bar, beside
  the paper's mean ± std band.

A configuration is a run's `reproduce.seeds`, `reproduce.first_seed` and `reproduce.protocol.<dataset>.*`
params; it is labelled by the params that differ between the compared runs (`model.heads=4`). Both
files are logged to a run of the `gat-repro-compare` experiment (`--no-log`: not).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlflow
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from gat.datasets import DATASETS
from stages.support.files import write_atomic
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, check_tracking_uri, fail, repo_root
from stages.support.store import COMPARE_EXPERIMENT, REPRODUCE_EXPERIMENT, shown_uri, use_store
from stages.support.tables import pct
from stages.support.tracking import code_span, stage_run

# The params of a reproduction that change its result (the others say where and how fast it ran).
RESULT_PARAMS = ("reproduce.seeds", "reproduce.first_seed")


@dataclass(frozen=True)
class Configuration:
    """One reproduced configuration of one dataset: the newest parent run with these params."""

    dataset: str
    params: dict[str, str]  # RESULT_PARAMS by their full key, the protocol's as `model.heads`, `optim.lr`, ...
    run: Run

    @property
    def metrics(self) -> dict[str, float]:
        return self.run.data.metrics

    @property
    def experiment(self) -> str:
        return self.run.data.tags.get("dvc_exp_name", "")


def result_params(run: Run) -> dict[str, str]:
    """The params that define what a parent run computed, the protocol's without the dataset's prefix."""
    dataset = run.data.tags.get("dataset", "")
    prefix = f"reproduce.protocol.{dataset}."
    params = {key: value for key, value in run.data.params.items() if key in RESULT_PARAMS}
    return params | {key.removeprefix(prefix): value for key, value in run.data.params.items()
                     if key.startswith(prefix)}


def parent_runs(client: MlflowClient, experiments: Sequence[str]) -> list[Run]:
    """The FINISHED parents (only they have `test_acc_mean`) of the named DVC experiments, or all; newest first."""
    found = client.get_experiment_by_name(REPRODUCE_EXPERIMENT)
    if found is None:
        return []
    query = "attributes.status = 'FINISHED' and metrics.test_acc_mean >= 0"
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs([found.experiment_id], query, order_by=["attributes.start_time DESC"],
                                  max_results=1000, page_token=token)
        runs += page
        token = page.token
        if not token:
            break
    runs = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    if experiments:
        runs = [run for run in runs if run.data.tags.get("dvc_exp_name") in experiments]
    return runs


def configurations(runs: Sequence[Run]) -> list[Configuration]:
    """The newest run of each (dataset, configuration); `runs` come newest first."""
    seen: dict[tuple[str, str], Configuration] = {}
    for run in runs:
        dataset = run.data.tags.get("dataset", "?")
        params = result_params(run)
        key = (dataset, json.dumps(params, sort_keys=True))
        seen.setdefault(key, Configuration(dataset, params, run))
    return list(seen.values())


def varied(configs: Sequence[Configuration]) -> list[str]:
    """The params whose value differs between the configurations, across datasets (model.heads, ...)."""
    keys = sorted({key for config in configs for key in config.params})
    return [key for key in keys if len({config.params.get(key) for config in configs}) > 1]


def label(config: Configuration, keys: Sequence[str]) -> str:
    shown = ", ".join(f"{key.removeprefix('reproduce.')}={config.params.get(key, '-')}" for key in keys)
    return shown or "the one configuration"


def by_dataset(configs: Sequence[Configuration]) -> dict[str, list[Configuration]]:
    """Per dataset (in the paper's order), best mean test accuracy first."""
    order = {name: i for i, name in enumerate(DATASETS)}
    grouped: dict[str, list[Configuration]] = {}
    for config in sorted(configs, key=lambda c: (order.get(c.dataset, len(order)), c.dataset,
                                                 -c.metrics["test_acc_mean"], c.run.info.run_id)):
        grouped.setdefault(config.dataset, []).append(config)
    return grouped


def markdown(configs: Sequence[Configuration], keys: Sequence[str], store: str) -> str:
    lines = ["# Reproduced configurations compared", "",
             f"Generated by `python -m tools.compare` from the `{REPRODUCE_EXPERIMENT}` runs of {store}. Per "
             "dataset, best mean test accuracy first; the configuration lists the params that differ between the "
             f"compared runs ({', '.join(f'`{key}`' for key in keys) or 'none: one configuration'}).", "",
             "| dataset | configuration | seeds | test accuracy, mean ± std | 95% CI of the mean | paper (GAT) "
             "| dvc experiment | MLflow run |",
             "|---|---|---|---|---|---|---|---|"]
    for dataset, rows in by_dataset(configs).items():
        paper = DATASETS[dataset].paper if dataset in DATASETS else None
        for config in rows:
            m = config.metrics
            lines.append(
                f"| {dataset} | {label(config, keys)} | {int(m.get('seeds', 0))} "
                f"| {pct(m['test_acc_mean'])} ± {pct(m.get('test_acc_std', float('nan')))} % "
                f"| [{pct(m['test_acc_ci95_low'])}, {pct(m['test_acc_ci95_high'])}] % "
                f"| {f'{pct(paper.mean)} ± {pct(paper.std)} %' if paper else '-'} "
                f"| {config.experiment or '-'} | `{config.run.info.run_id}` |")
    return "\n".join(lines) + "\n"


def figure(configs: Sequence[Configuration], keys: Sequence[str]):
    """One panel per dataset: each configuration's mean test accuracy and 95% CI, and the paper's band."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the project machines
    import matplotlib.pyplot as plt

    grouped = by_dataset(configs)
    tallest = max(len(rows) for rows in grouped.values())
    panels, axes_list = plt.subplots(1, len(grouped), figsize=(6.5 * len(grouped), 2.2 + 0.45 * tallest),
                                     squeeze=False)
    for axes, (dataset, rows) in zip(axes_list[0], grouped.items()):
        rows = rows[::-1]  # best at the top
        means = [100 * c.metrics["test_acc_mean"] for c in rows]
        low = [mean - 100 * c.metrics["test_acc_ci95_low"] for mean, c in zip(means, rows)]
        high = [100 * c.metrics["test_acc_ci95_high"] - mean for mean, c in zip(means, rows)]
        positions = list(range(len(rows)))
        if dataset in DATASETS:
            paper = DATASETS[dataset].paper
            axes.axvspan(100 * (paper.mean - paper.std), 100 * (paper.mean + paper.std), color="orange", alpha=0.2,
                         label="paper mean ± std")
        axes.errorbar(means, positions, xerr=[low, high], fmt="o", color="#4c72b0", capsize=4,
                      label="mean, 95% CI")
        axes.set_yticks(positions, [f"{label(c, keys)} ({int(c.metrics.get('seeds', 0))} seeds)" for c in rows])
        axes.set(xlabel="test accuracy (%)", title=dataset, ylim=(-0.6, len(rows) - 0.4))
        axes.grid(axis="x", alpha=0.3)
    handles, labels = axes_list[0][0].get_legend_handles_labels()
    panels.legend(handles, labels, loc="lower center", ncol=2, fontsize="small", frameon=False)
    panels.suptitle("Mean test accuracy with its 95% CI, per configuration")
    panels.tight_layout(rect=(0, 0.1, 1, 1))
    return panels


def run() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exp", action="append", default=[], metavar="NAME",
                        help="only the runs of this DVC experiment (repeat it for several); default: every run")
    parser.add_argument("--markdown", type=Path, default=Path("reports/compare.md"))
    parser.add_argument("--plot", type=Path, default=Path("reports/compare.png"))
    parser.add_argument("--no-log", action="store_true", help="don't log the table and plot to MLflow")
    args = parser.parse_args()
    check_tracking_uri()
    use_store()  # a server is checked first: unreachable or refusing is one line
    store = shown_uri()  # for messages and the table: never a password
    configs = configurations(parent_runs(MlflowClient(), args.exp))
    if not configs:
        which = f"of the DVC experiments {', '.join(args.exp)} " if args.exp else ""
        fail(f"no finished reproduce runs {which}in the MLflow store {store}: run `dvc repro` or a queued sweep "
             "(`dvc exp run --queue -S ...`, then `dvc queue start`) first.")
    keys = varied(configs)
    table = markdown(configs, keys, store)
    picture = figure(configs, keys)
    summary: dict[str, Any] = {"varied": keys, "configurations": [
        {"dataset": c.dataset, "configuration": label(c, keys), "params": c.params, "dvc_exp_name": c.experiment,
         "run_id": c.run.info.run_id, **{k: c.metrics.get(k) for k in (
             "seeds", "test_acc_mean", "test_acc_std", "test_acc_ci95_low", "test_acc_ci95_high", "val_acc_mean")}}
        for rows in by_dataset(configs).values() for c in rows]}
    root = repo_root()
    markdown_path, plot_path = (path if path.is_absolute() else root / path for path in (args.markdown, args.plot))
    write_atomic(markdown_path, table)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    staged = plot_path.with_name(f".{plot_path.name}.tmp.png")
    picture.savefig(staged, dpi=120)
    staged.replace(plot_path)
    if not args.no_log:
        experiments = sorted({c.experiment for c in configs if c.experiment})
        with stage_run(COMPARE_EXPERIMENT, f"compare-{len(configs)}-configurations", {
                "mlflow.note.content": f"{len(configs)} reproduced configurations compared; varied: "
                                       f"{', '.join(map(code_span, keys)) or 'nothing'}."}):
            mlflow.log_params({"varied": ",".join(keys) or "-", "dvc_experiments": ",".join(experiments)[:6000] or "-"})
            mlflow.log_metrics({"configurations": len(configs), "runs": len({c.run.info.run_id for c in configs})})
            mlflow.log_text(table, "compare.md")
            mlflow.log_figure(picture, "compare.png")
            mlflow.log_dict(summary, "compare.json")
    print(table)
    print(f"{len(configs)} configurations -> {markdown_path}, {plot_path}")


if __name__ == "__main__":
    main(run)
