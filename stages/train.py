"""Train one GAT with the paper's protocol; log every epoch to MLflow and to a DVC plots file.

    python -m stages.train --data data/prepared/cora --out data/train

Writes `model.pt` (gat.model.model_state), `history.csv` (one row per epoch) and
`run.json` (the MLflow run that the evaluate stage completes, so a configuration is one row).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import mlflow
import torch
from tqdm import tqdm

from gat.config import flatten
from gat.model import NodeClassifier, model_state
from gat.training import EpochMetrics, GraphTensors, resolve_device, train
from stages._common import load_params, load_prepared, main, write_atomic, write_csv, write_json
from stages._tracking import TRAIN_EXPERIMENT, EpochLogger, log_dataset, stage_run, standard_tags


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.train
    graph, meta = load_prepared(args.data, settings.dataset)
    device = resolve_device(settings.device)
    tensors = GraphTensors.from_graph(graph, device)

    tags = standard_tags(settings.dataset, meta["source_sha256"])
    run_name = f"{settings.dataset}-{tags.get('dvc_exp_name', f'seed{settings.seed}')}"
    with stage_run(TRAIN_EXPERIMENT, run_name, tags) as active:
        # Every value that shapes this run, with params.yaml's dotted keys, so runs compare column by column.
        mlflow.log_params(flatten({"datasets": params.datasets, "download": params.download,
                                   "preprocess": params.preprocess, "model": params.model, "train": settings}))
        log_dataset(settings.dataset, params.download.base_url, meta["source_sha256"], context="training")
        history: list[dict] = []
        with tqdm(desc=f"train {settings.dataset}", unit="epoch", disable=None) as bar, \
                EpochLogger(active.info.run_id) as logger:
            def on_epoch(m: EpochMetrics) -> None:
                row = {"epoch": m.epoch, "train_loss": m.train_loss.item(), "train_acc": m.train_acc.item(),
                       "val_loss": m.val_loss.item(), "val_acc": m.val_acc.item()}
                history.append(row)
                logger.log(row)
                bar.update()
                bar.set_postfix(val_acc=f"{row['val_acc']:.3f}", val_loss=f"{row['val_loss']:.3f}")

            result = train(tensors, params.model, settings.optim, [settings.seed], on_epoch)

        mlflow.log_metrics({"epochs": int(result.epochs[0]), "best_epoch": int(result.best_epoch[0]),
                            "best_val_acc": float(result.best_val_acc[0]),
                            "best_val_loss": float(result.best_val_loss[0])})
        model = result.model.cpu()
        classifier = NodeClassifier(model, tensors.x.to("cpu"), tensors.neighbourhoods.to("cpu"))
        example = graph.test_idx[:5]
        # Pickle, not MLflow's default pt2 export, which cannot trace sparse CSR tensors; gat/ travels with it.
        mlflow.pytorch.log_model(
            classifier, name="model", code_paths=["gat"], serialization_format="pickle",
            input_example=example.numpy(), pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            signature=mlflow.models.infer_signature(example.numpy(), classifier(example).numpy()))

        buffer = io.BytesIO()
        torch.save(model_state(model, graph.num_features, graph.num_classes, [settings.seed]), buffer)
        write_atomic(args.out / "model.pt", buffer.getvalue())
        write_csv(args.out / "history.csv", history)
        write_json(args.out / "run.json", {"run_id": active.info.run_id,
                                          "experiment_id": active.info.experiment_id})
    print(f"{settings.dataset}: stopped after {int(result.epochs[0])} epochs, restored epoch "
          f"{int(result.best_epoch[0])} (val acc {float(result.best_val_acc[0]):.4f}) -> {args.out}")


if __name__ == "__main__":
    main(run)
