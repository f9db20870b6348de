"""Measure the trained model on the test split and complete its MLflow run: the one evaluation.

    python -m stages.evaluate --data data/prepared/cora --train data/train --out data/eval

Writes `metrics.json` (for `dvc metrics show`), `per_class.json` (test precision, recall,
F1 and support per class), `predictions.csv` (test nodes, for the confusion-matrix plot) and
`evaluation.json` (every node's predicted class and the test confusion matrix, which the analyze
stage reads instead of evaluating again). Its metrics go into the train stage's run, so one
configuration is one row and the UI shows what `dvc metrics show` shows (epochs and best_epoch
are the train stage's, logged there). The run also gets the per-class table, the confusion matrix
as JSON, and, when its val_acc beats the registered champion's, the `champion` alias of the
registered model `gat-<dataset>`.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from sklearn.metrics import precision_recall_fscore_support

from gat.analysis import confusion_counts
from gat.training import GraphTensors, evaluate
from stages.support.champion import promote_if_champion
from stages.support.figures import class_names
from stages.support.files import RUN_JSON, load_json, load_model, load_prepared, outputs_together, write_csv, write_json
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, fail, load_params
from stages.support.tracking import stage_run


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--train", required=True, type=Path, help="the train stage's output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    dataset = load_params().train.dataset
    graph, meta = load_prepared(args.data, dataset)
    _state, model = load_model(args.train)
    # model_uri checked on its own: a run.json without it comes from an older train stage, not a damaged one.
    written_by_any_version = {key: kind for key, kind in RUN_JSON.items() if key != "model_uri"}
    trained = load_json(args.train / "run.json", "train", written_by_any_version)
    if not isinstance(trained.get("model_uri"), str):
        fail(f"{args.train / 'run.json'} comes from an older version of the train stage: "
             "run `dvc repro --force train`.")
    tensors = GraphTensors.from_graph(graph)
    result = evaluate(model, tensors)

    every_node = result.predicted[:, 0].numpy()
    actual, predicted = tensors.labels[tensors.test_idx].numpy(), every_node[tensors.test_idx.numpy()]
    classes = list(range(graph.num_classes))
    names = class_names(dataset, graph.num_classes, meta)
    precision, recall, f1, support = precision_recall_fscore_support(actual, predicted, labels=classes,
                                                                     zero_division=0)
    # Exactly what the UI's runs table shows: the restored checkpoint's figures, few and short-named. This stage
    # logs what it measures; epochs and best_epoch, in metrics.json too, the train stage logged.
    measured = {"test_acc": float(result.test_acc[0]), "val_acc": float(result.val_acc[0]),
                "test_macro_f1": float(f1.mean()), "test_loss": float(result.test_loss[0]),
                "val_loss": float(result.val_loss[0])}
    metrics = measured | {"epochs": int(trained["epochs"]), "best_epoch": int(trained["best_epoch"])}
    per_class = {str(c): {"name": names[c], "precision": float(precision[c]), "recall": float(recall[c]),
                          "f1": float(f1[c]), "support": int(support[c])} for c in classes}
    confusion = confusion_counts(actual, predicted, graph.num_classes).tolist()

    # Resume the train stage's run: the test accuracy belongs on the row of its configuration.
    with stage_run(run_id=trained["run_id"]):
        mlflow.log_metrics(measured)
        mlflow.log_table({"class": classes, **{key: [per_class[str(c)][key] for c in classes]
                                               for key in ("name", "precision", "recall", "f1", "support")}},
                         "per_class_table.json")
        mlflow.log_dict(per_class, "per_class.json")
        mlflow.log_dict({"labels": classes, "names": names, "rows_actual_columns_predicted": confusion},
                        "confusion_matrix.json")
        champion = promote_if_champion(trained["run_id"], trained["model"], trained["model_uri"],
                                       metrics["val_acc"])

        with outputs_together():
            write_json(args.out / "metrics.json", metrics)
            write_json(args.out / "per_class.json", per_class)
            write_csv(args.out / "predictions.csv", [{"node": int(n), "actual": int(a), "predicted": int(p)}
                                                     for n, a, p in zip(tensors.test_idx, actual, predicted)])
            write_json(args.out / "evaluation.json", {"predicted": every_node.tolist(), "confusion": confusion})
    print(f"{dataset}: test accuracy {metrics['test_acc']:.4f}, validation {metrics['val_acc']:.4f} -> {args.out}"
          f"; {champion}")


if __name__ == "__main__":
    main(run)
