"""Pictures logged to MLflow beside the JSON: the confusion matrix, the per-epoch curves, the analyze stage's and
the ablation's (matplotlib, Agg)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on the project machines; a PNG is all MLflow needs
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.figure import Figure  # noqa: E402

from gat.datasets import DATASETS  # noqa: E402

if TYPE_CHECKING:
    from stages.support.ablation_report import Outcome


def class_names(dataset: str, num_classes: int, meta: Mapping[str, object] | None = None) -> list[str]:
    """The dataset's class names, or the class ids when the data does not have the known number of classes.

    `meta`: the prepared meta.json, whose `class_names` an npz graph's names come from (the kept classes', in order).
    """
    from_meta = (meta or {}).get("class_names")
    names = (tuple(map(str, from_meta)) if isinstance(from_meta, list)
             else DATASETS[dataset].class_names if dataset in DATASETS else ())
    return list(names) if len(names) == num_classes else [str(c) for c in range(num_classes)]


def confusion_figure(shares: Sequence[Sequence[float]], names: Sequence[str], title: str) -> Figure:
    """Test nodes by true class (rows) and predicted class (columns), each row divided by its class's test nodes
    (gat.analysis.row_shares: the recall on the diagonal), the fractions written in the cells."""
    figure, axes = plt.subplots(figsize=(7.5, 6.5))
    image = axes.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    axes.set_xticks(range(len(names)), names, rotation=40, ha="right")
    axes.set_yticks(range(len(names)), names)
    for i, row in enumerate(shares):
        for j, share in enumerate(row):
            axes.text(j, i, f"{share:.2f}", ha="center", va="center", color="white" if share > 0.5 else "black")
    axes.set(xlabel="predicted class", ylabel="true class", title=title)
    figure.colorbar(image, ax=axes, label="fraction of the true class's test nodes")
    figure.tight_layout()
    return figure


def curves_figure(history: Sequence[Mapping[str, float]], best_epoch: int, title: str) -> Figure:
    """Loss and accuracy per epoch, training (under dropout) and validation, with the restored epoch marked."""
    epochs = [row["epoch"] for row in history]
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for axes, metric in ((loss_axes, "loss"), (accuracy_axes, "acc")):
        axes.plot(epochs, [row[f"train_{metric}"] for row in history], label="train (dropout on)", linewidth=1)
        axes.plot(epochs, [row[f"val_{metric}"] for row in history], label="validation", linewidth=1)
        axes.axvline(best_epoch, color="black", linestyle="--", linewidth=1, label=f"restored epoch {best_epoch}")
        axes.set(xlabel="epoch", ylabel="accuracy" if metric == "acc" else "cross-entropy loss")
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    return figure


# The analyze stage's pictures -----------------------------------------------------------------------------------

# Every PNG is rendered at this resolution, so a figure's size in inches fixes its size in pixels.
DPI = 100


def png_bytes(figure: Figure) -> bytes:
    """The figure as PNG bytes that depend on nothing but its content, and the figure closed.

    Matplotlib writes its version into a PNG's `Software` chunk (and no date): dropped, so that the bytes
    stay the same when only the library changes. The size is the figure's, at DPI (no tight bounding box).
    """
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def class_colours(num_classes: int) -> list:
    """One colour per class, the same in every picture (tab10, or tab20 beyond ten classes)."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20"]
    return [palette(c % palette.N) for c in range(num_classes)]


def entropy_figure(entropy: Sequence, uniform, title: str) -> Figure:
    """Per layer and head, a histogram of the nodes' attention entropy beside uniform attention's, log in-degree.

    Shapes: entropy: one [N, H_l] array per layer; uniform: [N]
    """
    import math

    import numpy as np

    panels = [(layer, head) for layer, values in enumerate(entropy) for head in range(values.shape[1])]
    columns = math.ceil(math.sqrt(len(panels)))
    rows = math.ceil(len(panels) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(12, 10), squeeze=False, sharex=True)
    top = max(float(np.max(uniform)), *(float(np.max(values)) for values in entropy))
    bins = np.linspace(0.0, top * 1.02 + 1e-9, 31)
    for axes, (layer, head) in zip(grid.flat, panels):
        values = entropy[layer][:, head]
        axes.hist(uniform, bins=bins, histtype="step", color="black", linewidth=1.2,
                  label="uniform attention: log in-degree")
        axes.hist(values, bins=bins, color="tab:orange", alpha=0.7, label="learned attention")
        gap = float(np.max(uniform - values))
        axes.set_title(f"layer {layer + 1}, head {head + 1}: mean {float(np.mean(values)):.3f} nats\n"
                       f"(uniform {float(np.mean(uniform)):.3f}; a node's largest gap {gap:.3f})", fontsize=10)
        axes.set(xlabel="entropy of α over the neighbourhood (nats)", ylabel="nodes")
        axes.xaxis.set_tick_params(labelbottom=True)
    for axes in list(grid.flat)[len(panels):]:
        axes.set_axis_off()
    handles, labels = grid.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    return figure


def embedding_figure(points, labels, is_test, names: Sequence[str], title: str) -> Figure:
    """A 2-D map of the nodes, coloured by class, test nodes drawn as crosses and the others as dots.

    Shapes: points: [N, 2]; labels: [N] class ids; is_test: [N] bool
    """
    from matplotlib.lines import Line2D

    colours = class_colours(len(names))
    figure, axes = plt.subplots(figsize=(10, 8))
    for c in range(len(names)):
        for test, marker, size in ((False, "o", 6), (True, "x", 12)):
            chosen = (labels == c) & (is_test == test)
            axes.scatter(points[chosen, 0], points[chosen, 1], s=size, marker=marker, color=colours[c],
                         linewidths=0.7 if test else 0, alpha=0.8)
    handles = [Line2D([], [], marker="o", linestyle="", color=colours[c], label=name) for c, name in enumerate(names)]
    handles += [Line2D([], [], marker="x", linestyle="", color="black", label="test node"),
                Line2D([], [], marker="o", linestyle="", markersize=3, color="black", label="other node")]
    axes.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    axes.set(xlabel="t-SNE 1", ylabel="t-SNE 2", title=title)
    figure.tight_layout()
    return figure


def _shell_layout(shells: list[list[int]]) -> dict[int, tuple[float, float]]:
    """networkx's shell_layout: ring s of radius (s + 1)/S (a lone centre at 0), turned by π/S per ring.

    Not networkx's own: it takes numpy's float32 cos and sin, which are vectorised per CPU (AVX2, AVX-512 or
    baseline code) and round differently on each, so the picture's bytes depended on the CPU. Python's scalar
    cos and sin, rounded to 1e-9 (far below a pixel) so that no last-bit difference reaches the drawing.
    """
    step = rotate = 1.0 / len(shells)
    radius = 0.0 if len(shells[0]) == 1 else step
    positions: dict[int, tuple[float, float]] = {}
    for ring, shell in enumerate(shells, start=1):
        for k, node in enumerate(shell):
            theta = math.pi * (rotate * ring + 2.0 * k / len(shell))
            positions[node] = (round(radius * math.cos(theta), 9), round(radius * math.sin(theta), 9))
        radius += step
    return positions


def neighbourhood_figure(views: Sequence, labels, predicted, names: Sequence[str], title: str) -> Figure:
    """One panel per example node: its 2-hop neighbourhood, nodes coloured by true class, each edge j -> i
    as wide as the attention α_ij that carries j towards the centre (gat.analysis.Neighbourhood).

    Shapes: labels, predicted: [N] class ids
    """
    import networkx as nx
    from matplotlib.lines import Line2D

    colours = class_colours(len(names))
    columns = math.ceil(math.sqrt(len(views)))
    rows = math.ceil(len(views) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(15, 10), squeeze=False)
    for axes, view in zip(grid.flat, views):
        graph = nx.DiGraph()
        nodes = view.nodes.tolist()
        graph.add_nodes_from(nodes)
        widths = [0.3 + 6.0 * float(a) for a in view.alpha]
        graph.add_edges_from(view.edges.tolist())
        shells = [[n for n, hop in zip(nodes, view.hops.tolist()) if hop == h] for h in (0, 1, 2)]
        position = _shell_layout([shell for shell in shells if shell])
        size = 220 if len(nodes) <= 40 else 60
        nx.draw_networkx_edges(graph, position, ax=axes, edgelist=view.edges.tolist(), width=widths,
                               edge_color="dimgray", arrows=True, arrowstyle="-|>", arrowsize=7,
                               connectionstyle="arc3,rad=0.12", node_size=size)
        nx.draw_networkx_nodes(graph, position, ax=axes, nodelist=nodes, node_size=size,
                               node_color=[colours[int(labels[n])] for n in nodes],
                               edgecolors=["black" if n == view.centre else "white" for n in nodes],
                               linewidths=[2.5 if n == view.centre else 0.5 for n in nodes])
        truth, guess = int(labels[view.centre]), int(predicted[view.centre])
        verdict = "right" if truth == guess else "wrong"
        axes.set_title(f"test node {view.centre} ({verdict}): {len(nodes)} nodes within 2 hops\n"
                       f"true {names[truth]}, predicted {names[guess]}", fontsize=10,
                       color="black" if truth == guess else "firebrick")
        axes.set_axis_off()
    for axes in list(grid.flat)[len(views):]:
        axes.set_axis_off()
    handles = [Line2D([], [], marker="o", linestyle="", markersize=8, color=colours[c], label=name)
               for c, name in enumerate(names)]
    handles += [Line2D([], [], marker="o", linestyle="", markersize=8, color="white", markeredgecolor="black",
                       markeredgewidth=2, label="the test node")]
    handles += [Line2D([], [], color="dimgray", linewidth=0.3 + 6.0 * a, label=f"α = {a:g}") for a in (0.1, 0.5, 1.0)]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), frameon=False, fontsize=9)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return figure


# The ablation's picture ------------------------------------------------------------------------------------------


def ablation_figure(found: Sequence[Outcome]) -> Figure:
    """Per dataset: each variant's mean test accuracy with its 95% CI, and each difference to gat with its CI."""
    datasets = list(dict.fromkeys(outcome.cell.dataset for outcome in found))
    variants = list(dict.fromkeys(outcome.cell.variant for outcome in found))
    panels, grid = plt.subplots(len(datasets), 2, figsize=(11, 0.8 + (1.0 + 0.45 * len(variants)) * len(datasets)),
                                squeeze=False)
    for (means, differences), dataset in zip(grid, datasets):
        rows = [outcome for outcome in found if outcome.cell.dataset == dataset][::-1]  # the first variant on top
        positions = list(range(len(rows)))
        mean = [100 * o.test.mean for o in rows]
        means.errorbar(mean, positions, fmt="o", color="#4c72b0", capsize=4,
                       xerr=[[m - 100 * o.test.ci_low for m, o in zip(mean, rows)],
                             [100 * o.test.ci_high - m for m, o in zip(mean, rows)]])
        means.set_yticks(positions, [o.cell.variant for o in rows])
        means.set(xlabel="test accuracy (%), mean and 95% CI", title=f"{dataset}: {rows[0].test.n} seeds each",
                  ylim=(-0.6, len(rows) - 0.4))
        compared = [(i, o.difference) for i, o in enumerate(rows) if o.difference is not None]
        differences.axvline(0.0, color="black", linewidth=1)
        differences.plot([0.0] * (len(rows) - len(compared)), [i for i, o in enumerate(rows) if o.difference is None],
                         "D", color="black", label="gat: the baseline")
        if compared:
            d_mean = [100 * d.mean for _, d in compared]
            differences.errorbar(d_mean, [i for i, _ in compared], fmt="o", color="#dd8452", capsize=4,
                                 xerr=[[m - 100 * d.ci_low for m, (_, d) in zip(d_mean, compared)],
                                       [100 * d.ci_high - m for m, (_, d) in zip(d_mean, compared)]])
        differences.set_yticks(positions, [o.cell.variant for o in rows])
        differences.set(xlabel="difference to gat (points), paired by seed, 95% CI", title=f"{dataset}: minus gat",
                        ylim=(-0.6, len(rows) - 0.4))
        for axes in (means, differences):
            axes.grid(axis="x", alpha=0.3)
    panels.tight_layout()
    return panels
