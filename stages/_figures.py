"""Pictures logged to MLflow beside the JSON: the confusion matrix and the per-epoch curves (matplotlib, Agg)."""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on the project machines; a PNG is all MLflow needs
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.figure import Figure  # noqa: E402

# Planetoid's one-hot label columns, named. The raw files carry no names; each column was matched to its
# subject area by its node count (Cora: 351 Theory, 217 Reinforcement_Learning, ... as in the LINQS release,
# whose per-class counts are all distinct).
CLASS_NAMES = {
    "cora": ("Theory", "Reinforcement_Learning", "Genetic_Algorithms", "Neural_Networks",
             "Probabilistic_Methods", "Case_Based", "Rule_Learning"),
    "citeseer": ("AI", "ML", "IR", "DB", "Agents", "HCI"),
}


def class_names(dataset: str, num_classes: int) -> list[str]:
    """The dataset's class names, or the class ids when the data does not have the known number of classes."""
    names = CLASS_NAMES.get(dataset, ())
    return list(names) if len(names) == num_classes else [str(c) for c in range(num_classes)]


def confusion_figure(confusion: Sequence[Sequence[int]], names: Sequence[str], title: str) -> Figure:
    """Test nodes by true class (rows) and predicted class (columns), with the counts written in the cells."""
    figure, axes = plt.subplots(figsize=(7.5, 6.5))
    image = axes.imshow(confusion, cmap="Blues")
    axes.set_xticks(range(len(names)), names, rotation=40, ha="right")
    axes.set_yticks(range(len(names)), names)
    peak = max((max(row) for row in confusion), default=0)
    for i, row in enumerate(confusion):
        for j, count in enumerate(row):
            axes.text(j, i, str(count), ha="center", va="center", color="white" if count > peak / 2 else "black")
    axes.set(xlabel="predicted class", ylabel="true class", title=title)
    figure.colorbar(image, ax=axes, label="test nodes")
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
