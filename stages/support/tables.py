"""How a reproduction is shown: the Markdown table rows, the DVC metrics and the histogram figure."""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from gat.datasets import Dataset

HEADER = ("| dataset | seeds | test accuracy, mean ± std | 95% CI of the mean | min – max | paper (GAT) "
          "| mean inside the paper's ± std? | epochs to stop, mean (min – max) |\n"
          "|---|---|---|---|---|---|---|---|\n")
VALIDATION_HEADER = ("| dataset | seeds | validation accuracy, mean ± std | 95% CI of the mean | min – max |\n"
                     "|---|---|---|---|---|\n")


def pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _spread(split: dict) -> str:
    """mean ± std | CI | min – max, in percent."""
    return (f"{pct(split['mean'])} ± {pct(split['std'])} % | [{pct(split['ci_low'])}, {pct(split['ci_high'])}] % "
            f"| {pct(split['min'])} – {pct(split['max'])} %")


def dataset_row(s: dict) -> str:
    """The test-accuracy row of one dataset, beside the paper's figure (none for a graph of `graphs`)."""
    epochs, paper = s["epochs"], s["paper"]
    published = f"{pct(paper['mean'])} ± {pct(paper['std'])} %" if paper else "no published result"
    inside = "-" if paper is None else "yes" if s["inside_paper_band"] else "no"
    return (f"| {s['dataset']} | {s['seeds']} | {_spread(s['test'])} | {published} | {inside} "
            f"| {epochs['mean']:.0f} ({epochs['min']:.0f} – {epochs['max']:.0f}) |\n")


def not_run_row(dataset: Dataset) -> str:
    """The row of a dataset without a reproduction here: the paper's figure alone."""
    paper = dataset.paper
    return (f"| {dataset.name} | – | not run here | – | – | {pct(paper.mean)} ± {pct(paper.std)} % | – | – |\n")


def validation_row(s: dict) -> str:
    return f"| {s['dataset']} | {s['seeds']} | {_spread(s['val'])} |\n"


def tables(summaries: list[dict], not_run: Sequence[Dataset] = ()) -> str:
    """Test accuracy beside the paper, then validation accuracy, one row per dataset; `not_run` datasets have a
    test row with the paper's figure alone."""
    return (HEADER + "".join(map(dataset_row, summaries)) + "".join(map(not_run_row, not_run)) + "\n"
            + VALIDATION_HEADER + "".join(map(validation_row, summaries)))


def dataset_section(summary: dict) -> str:
    """The tables of one dataset, as its MLflow parent run holds them."""
    return f"# GAT reproduction: {summary['dataset']}\n\n" + tables([summary])


def metrics(summary: dict) -> dict:
    """The flat keys `dvc metrics show` lists under the dataset's name (accuracies as fractions)."""
    flat = {"seeds": summary["seeds"]}
    for split, prefix in (("test", "test_acc"), ("val", "val_acc")):
        values = summary[split]
        flat |= {f"{prefix}_mean": values["mean"], f"{prefix}_std": values["std"], f"{prefix}_min": values["min"],
                 f"{prefix}_max": values["max"], f"{prefix}_ci95_low": values["ci_low"],
                 f"{prefix}_ci95_high": values["ci_high"]}
    epochs = summary["epochs"]
    flat |= {"epochs_mean": epochs["mean"], "epochs_min": epochs["min"], "epochs_max": epochs["max"]}
    if summary["paper"] is None:  # a graph of `graphs`: the paper did not run it
        return flat
    return flat | {"paper_test_acc_mean": summary["paper"]["mean"], "paper_test_acc_std": summary["paper"]["std"],
                   "inside_paper_band": summary["inside_paper_band"]}


def histogram_bins(counts: Sequence[tuple[Fraction | float, Fraction | float, int]]) -> list[dict]:
    """gat.reproduction.histogram's bins as `histogram.csv` and `summary.json` hold them: `0.830-0.835`, seeds."""
    return [{"test_acc_bin": f"{float(low):.3f}-{float(high):.3f}", "seeds": count} for low, high, count in counts]


def histogram_figure(bins: Sequence[dict], summary: dict):
    """The seeds per bin of test accuracy, the bins and counts of `histogram.csv` (`histogram_bins`) drawn as
    they are, not binned again; with the paper's mean ± std band and this project's mean."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the project machines; a PNG is all MLflow needs
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    edges = [tuple(100 * float(edge) for edge in row["test_acc_bin"].split("-")) for row in bins]
    axes.bar([low for low, _ in edges], [row["seeds"] for row in bins], width=[high - low for low, high in edges],
             align="edge", color="#4c72b0", edgecolor="white")
    paper = summary["paper"]
    if paper is not None:
        axes.axvspan(100 * (paper["mean"] - paper["std"]), 100 * (paper["mean"] + paper["std"]), alpha=0.2,
                     color="orange", label="paper mean ± std")
    axes.axvline(100 * summary["test"]["mean"], color="black", label="this project's mean")
    axes.set(xlabel="test accuracy (%)", ylabel="seeds", title=f"{summary['dataset']}: {summary['seeds']} seeds")
    axes.legend()
    figure.tight_layout()
    return figure
