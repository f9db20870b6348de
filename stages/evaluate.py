"""Measure the trained model on the test split and complete its MLflow run.

    python -m stages.evaluate --data data/prepared/cora --train data/train --out data/eval

Writes `metrics.json` (for `dvc metrics show`), `per_class.json` (test precision, recall,
F1 and support per class) and `predictions.csv` (test nodes, for the confusion-matrix plot). The metrics go into the train stage's run, so one configuration is one row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlflow
import torch
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

from gat.model import model_from_state
from gat.training import GraphTensors, loss_and_accuracy, predict
from stages._common import load_params, load_prepared, main, require, write_csv, write_json
from stages._tracking import stage_run


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--train", required=True, type=Path, help="the train stage's output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    dataset = load_params().train.dataset
    graph, _meta = load_prepared(args.data, dataset)
    state = torch.load(require(args.train / "model.pt", "train"), weights_only=True)
    run_id = json.loads(require(args.train / "run.json", "train").read_text())["run_id"]
    tensors = GraphTensors.from_graph(graph)
    logits = predict(model_from_state(state), tensors)  # [N, 1, C]

    metrics = {}
    for split, index in (("val", tensors.val_idx), ("test", tensors.test_idx)):
        loss, accuracy = loss_and_accuracy(logits, tensors.labels, index)
        metrics |= {f"{split}_acc": float(accuracy[0]), f"{split}_loss": float(loss[0])}
    actual = tensors.labels[tensors.test_idx].numpy()
    predicted = logits[tensors.test_idx, 0].argmax(-1).numpy()
    classes = list(range(graph.num_classes))
    precision, recall, f1, support = precision_recall_fscore_support(actual, predicted, labels=classes,
                                                                     zero_division=0)
    metrics["test_macro_f1"] = float(f1.mean())
    per_class = {str(c): {"precision": float(precision[c]), "recall": float(recall[c]), "f1": float(f1[c]),
                          "support": int(support[c])} for c in classes}
    confusion = confusion_matrix(actual, predicted, labels=classes).tolist()

    # Resume the train stage's run: the test accuracy belongs on the row of its configuration.
    with stage_run(run_id=run_id):
        mlflow.log_metrics(metrics)
        mlflow.log_metrics({f"test_{k}_class_{c}": v[k] for c, v in per_class.items()
                            for k in ("precision", "recall", "f1")})
        mlflow.log_dict({"labels": classes, "rows_actual_columns_predicted": confusion}, "confusion_matrix.json")
        mlflow.log_dict(per_class, "per_class.json")

    write_json(args.out / "metrics.json", metrics)
    write_json(args.out / "per_class.json", per_class)
    write_csv(args.out / "predictions.csv", [{"node": int(n), "actual": int(a), "predicted": int(p)}
                                             for n, a, p in zip(tensors.test_idx, actual, predicted)])
    print(f"{dataset}: test accuracy {metrics['test_acc']:.4f}, validation {metrics['val_acc']:.4f} -> {args.out}")


if __name__ == "__main__":
    main(run)
