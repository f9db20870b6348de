"""Look inside the trained model: attention entropy, the embedding map, neighbourhood views, curves and confusion.

    python -m stages.analyze --data data/prepared/cora --train data/train --eval data/eval --out data/analysis

Reads the evaluate stage's `evaluation.json` (every node's predicted class, the test confusion matrix)
rather than evaluating the model again. Writes five PNGs and `metrics.json` (mean attention entropy per
layer against uniform attention, the silhouette of the classes in the first layer's output and in its t-SNE
map), and logs them all into the training configuration's MLflow run (the one train and evaluate write; its
id is in run.json), under `analysis/`. Same params, same bytes, on any x86-64 CPU: the α and the first
layer's output are recomputed in float64 without any CPU-dispatched arithmetic
(gat.analysis.portable_inspect), and so are the distances, the PCA initialisation and the neighbours that
t-SNE and the silhouettes start from (see gat.analysis); every computation runs on one thread, and the PNGs
carry no library version.
"""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path

import matplotlib
import mlflow
import numpy as np
import torch
from threadpoolctl import threadpool_limits

from gat.analysis import (attention_entropy, neighbourhood, pick_examples, portable_inspect, row_shares, silhouette,
                          tsne, two_hop_sizes, uniform_entropy)
from gat.training import GraphTensors
from stages.support.figures import (class_names, confusion_figure, curves_figure, embedding_figure, entropy_figure,
                                    neighbourhood_figure, png_bytes)
from stages.support.files import (RUN_JSON, load_evaluation, load_json, load_model, load_prepared, outputs_together,
                                  require, write_atomic)
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, fail, load_params
from stages.support.tracking import stage_run

# What the stage writes, each PNG with its size in pixels (width, height), as the README lists them.
PICTURES = {
    "attention_entropy.png": (1200, 1000),
    "embedding_tsne.png": (1000, 800),
    "neighbourhoods.png": (1500, 1000),
    "training_curves.png": (1100, 400),
    "confusion_matrix.png": (750, 650),
}


def _metric(value: float) -> float:
    """Six decimals: the figures carry no float noise into metrics.json and the runs table."""
    return round(float(value), 6)


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--train", required=True, type=Path, help="the train stage's output folder")
    parser.add_argument("--eval", required=True, type=Path, help="the evaluate stage's output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings, dataset = params.analyze, params.train.dataset
    graph, meta = load_prepared(args.data, dataset)
    state, model = load_model(args.train)
    trained = load_json(args.train / "run.json", "train", {key: RUN_JSON[key] for key in ("run_id", "best_epoch")})
    with require(args.train / "history.csv", "train").open() as handle:
        history = [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]

    # Every check before any work, and before the training run is touched: a failure leaves both as they were.
    if (state["in_features"], state["num_classes"]) != (graph.num_features, graph.num_classes):
        fail(f"{args.train / 'model.pt'} was trained on a graph with {state['in_features']} features and "
             f"{state['num_classes']} classes, but {args.data} ({dataset}) has {graph.num_features} and "
             f"{graph.num_classes}: it is another dataset's model. Retrain it with `dvc repro train`.")
    if len(state["seeds"]) != 1:
        fail(f"{args.train / 'model.pt'} holds {len(state['seeds'])} replicas; the train stage saves one.")
    every_node, counts = load_evaluation(args.eval, graph.num_nodes, graph.num_classes)
    if settings.example_nodes > graph.test_idx.numel():
        fail(f"params.yaml: `analyze.example_nodes` is {settings.example_nodes}, but the test set of {dataset} "
             f"has only {graph.test_idx.numel()} nodes; lower it.")
    labelled = torch.nonzero(graph.labels >= 0).view(-1)  # Citeseer's padded test nodes have no class
    if not settings.tsne_perplexity < labelled.numel():
        fail(f"params.yaml: `analyze.tsne_perplexity` ({settings.tsne_perplexity}) must be below the number of "
             f"labelled nodes ({labelled.numel()}); lower it.")

    matplotlib.rcdefaults()  # a user's matplotlibrc must not change the pictures
    tensors = GraphTensors.from_graph(graph)
    # Not model.inspect(): torch's float32 pass rounds by CPU (ATEN_CPU_CAPABILITY, MKL), and t-SNE turns a
    # last-bit difference into another map. This float64 pass gives the same bytes everywhere.
    inside = portable_inspect(model, tensors.x, tensors.neighbourhoods)
    predicted = torch.tensor(every_node, dtype=torch.int64)  # the evaluate stage's, not a second evaluation
    names = class_names(dataset, graph.num_classes, meta)

    # 1. Attention entropy per layer and head, against uniform attention over the same neighbourhoods.
    entropy = [attention_entropy(alpha[:, 0], tensors.neighbourhoods).numpy() for alpha in inside.attention]
    uniform = uniform_entropy(tensors.neighbourhoods).numpy()
    metrics = {"attention_entropy_uniform": _metric(uniform.mean())}
    for layer, values in enumerate(entropy, start=1):
        metrics[f"attention_entropy_layer{layer}"] = _metric(values.mean())
    ratios = [metrics[f"attention_entropy_layer{layer}"] / metrics["attention_entropy_uniform"] for layer in (1, 2)]

    # 2. The first layer's output of every labelled node, mapped by t-SNE; one thread, so the map is reproducible.
    hidden, labels = torch.from_numpy(inside.hidden[labelled.numpy()]), graph.labels[labelled]
    with threadpool_limits(limits=1):
        points = tsne(hidden, settings.tsne_perplexity, settings.tsne_max_iter)
        metrics["silhouette_layer1"] = _metric(silhouette(hidden, labels))
        metrics["silhouette_tsne"] = _metric(silhouette(points, labels))
    is_test = torch.isin(labelled, graph.test_idx).numpy()

    # 3. A few test nodes, some classified wrong and some right, with the α on their 2-hop neighbourhood.
    test_idx = graph.test_idx[graph.labels[graph.test_idx] >= 0]
    examples = pick_examples(test_idx, predicted[test_idx] == graph.labels[test_idx],
                             two_hop_sizes(tensors.neighbourhoods), settings.example_nodes, settings.max_drawn_nodes)
    views = [neighbourhood(tensors.neighbourhoods, inside.attention, node) for node in examples]

    # 4. The curves of training, and where on the test set the restored model goes wrong.
    confusion = np.array(counts, dtype=np.int64)
    accuracy = f"test accuracy {np.trace(confusion) / confusion.sum():.3f}"  # evaluate's test_acc, not logged twice
    pictures = {
        "attention_entropy.png": entropy_figure(
            entropy, uniform, f"{dataset}: entropy of each node's attention, per layer and head, against uniform "
                              f"attention (ratio {ratios[0]:.4f} in layer 1, {ratios[1]:.4f} in layer 2)"),
        "embedding_tsne.png": embedding_figure(
            points, labels.numpy(), is_test, names,
            f"{dataset}: t-SNE of layer 1's output (perplexity {settings.tsne_perplexity:g}, PCA start)"
            f"\nclass silhouette {metrics['silhouette_layer1']:.3f} in the "
            f"{hidden.shape[1]}-d output, {metrics['silhouette_tsne']:.3f} in the map"),
        "neighbourhoods.png": neighbourhood_figure(
            views, graph.labels, predicted, names,
            f"{dataset}: 2-hop neighbourhoods of test nodes; an edge's width is the attention α it gets "
            "(into the centre: layer 2; into a neighbour: layer 1; heads averaged)"),
        "training_curves.png": curves_figure(history, int(trained["best_epoch"]),
                                             f"{dataset}, seed {state['seeds'][0]}: training curves"),
        "confusion_matrix.png": confusion_figure(row_shares(confusion).tolist(), names,
                                                 f"{dataset}: normalised test confusion matrix\n({accuracy})"),
    }
    files = {name: png_bytes(figure) for name, figure in pictures.items()}
    files["metrics.json"] = (json.dumps(metrics, indent=2, sort_keys=True) + "\n").encode()

    # Into the training configuration's run, beside its metrics and model: no new row.
    with stage_run(run_id=trained["run_id"]):
        mlflow.log_metrics(metrics)
        with tempfile.TemporaryDirectory() as folder:
            for name, data in files.items():
                (Path(folder) / name).write_bytes(data)
            mlflow.log_artifacts(folder, "analysis")
        with outputs_together():
            for name, data in files.items():
                write_atomic(args.out / name, data)
    print(f"{dataset}: attention entropy {metrics['attention_entropy_layer1']:.3f} / "
          f"{metrics['attention_entropy_layer2']:.3f} nats in layers 1 / 2, uniform "
          f"{metrics['attention_entropy_uniform']:.3f}; silhouette {metrics['silhouette_layer1']:.3f} -> {args.out}")


if __name__ == "__main__":
    main(run)
