"""How a reproduction is shown: the Markdown table rows, the DVC metrics and the histogram figure."""

from __future__ import annotations

HEADER = ("| dataset | seeds | test accuracy, mean ± std | 95% CI of the mean | min – max | paper (GAT) "
          "| mean inside the paper's ± std? | validation accuracy | epochs to stop, mean (min – max) |\n"
          "|---|---|---|---|---|---|---|---|---|\n")


def pct(value: float) -> str:
    return f"{100 * value:.2f}"


def dataset_row(s: dict) -> str:
    test, val, epochs, paper = s["test"], s["val"], s["epochs"], s["paper"]
    return (f"| {s['dataset']} | {s['seeds']} | {pct(test['mean'])} ± {pct(test['std'])} % "
            f"| [{pct(test['ci_low'])}, {pct(test['ci_high'])}] % | {pct(test['min'])} – {pct(test['max'])} % "
            f"| {pct(paper['mean'])} ± {pct(paper['std'])} % | {'yes' if s['inside_paper_band'] else 'no'} "
            f"| {pct(val['mean'])} ± {pct(val['std'])} % | {epochs['mean']:.0f} ({epochs['min']:.0f} – {epochs['max']:.0f}) |\n")


def dataset_section(summary: dict) -> str:
    """The table row of one dataset, as its MLflow parent run holds it."""
    return f"# GAT reproduction: {summary['dataset']}\n\n" + HEADER + dataset_row(summary)


def metrics(summary: dict) -> dict:
    """The flat keys `dvc metrics show` lists under the dataset's name (accuracies as fractions)."""
    test, val = summary["test"], summary["val"]
    return {"seeds": summary["seeds"], "test_acc_mean": test["mean"], "test_acc_std": test["std"],
            "test_acc_min": test["min"], "test_acc_max": test["max"], "test_acc_ci95_low": test["ci_low"],
            "test_acc_ci95_high": test["ci_high"], "val_acc_mean": val["mean"], "val_acc_std": val["std"],
            "epochs_mean": summary["epochs"]["mean"], "paper_test_acc_mean": summary["paper"]["mean"],
            "paper_test_acc_std": summary["paper"]["std"], "inside_paper_band": summary["inside_paper_band"]}


def histogram_figure(rows: list[dict], counts: list[tuple[float, float, int]], summary: dict):
    """Per-seed test accuracy with the paper's mean ± std band and this project's mean."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the project machines; a PNG is all MLflow needs
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    edges = [100 * low for low, _, _ in counts] + [100 * counts[-1][1]]
    axes.hist([100 * r["test_acc"] for r in rows], bins=edges, color="#4c72b0", edgecolor="white")
    paper = summary["paper"]
    axes.axvspan(100 * (paper["mean"] - paper["std"]), 100 * (paper["mean"] + paper["std"]), alpha=0.2,
                 color="orange", label="paper mean ± std")
    axes.axvline(100 * summary["test"]["mean"], color="black", label="this project's mean")
    axes.set(xlabel="test accuracy (%)", ylabel="seeds", title=f"{summary['dataset']}: {len(rows)} seeds")
    axes.legend()
    figure.tight_layout()
    return figure
