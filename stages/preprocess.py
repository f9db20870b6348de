"""Verify and parse one dataset's raw files, apply the split, and save the graph.

    python -m stages.preprocess --dataset cora --raw data/raw/cora --out data/prepared/cora

Writes `graph.pt` (gat.data.graph_to_tensors; torch.load(weights_only=True) reads it)
and `meta.json` (sizes, split settings, per-class counts, source checksums). A graph of params.yaml's `graphs`
(an npz file, gat.npz) gets the Pitfalls split of its `split_seed`; its meta.json adds its class names and the
classes the split dropped.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import mlflow
import torch

from gat.config import GraphSource
from gat.data import Graph, describe, graph_to_tensors, parse_planetoid, random_split
from gat.npz import TRAIN_PER_CLASS, VAL_PER_CLASS, dropped_summary, kept_class_names, npz_graph, parse_npz
from stages.support import fetch
from stages.support.files import atomic_dir, require, write_json
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, fail, load_params
from stages.support.redaction import redact
from stages.support.store import DATA_EXPERIMENT
from stages.support.tracking import log_dataset, logged_params, stage_run, standard_tags


def _parse(raw: dict[str, bytes], folder: Path, dataset: str) -> Graph:
    """parse_planetoid, with a refused file as one line naming it and the fix."""
    try:
        return parse_planetoid(raw, dataset)
    except (ValueError, pickle.UnpicklingError) as error:
        # One line, whatever a library's message holds; the file name leads it (`ind.cora.ty: ...`).
        problem = " ".join(str(error).split())
        # The bytes passed the pinned checksums, so they came from the mirror or a re-pinned list.
        fail(f"{folder}: {problem}. These are not the canonical Planetoid files: restore "
             f"gat/planetoid.sha256 if it was changed, fix or unset {fetch.MIRROR_ENV}, "
             f"and run `dvc repro --force download@{dataset}`.")


def _npz(raw: bytes, folder: Path, name: str, graph: GraphSource) -> tuple[Graph, dict]:
    """parse_npz and the seeded Pitfalls split, with a refused file as one line naming its field; the graph and
    meta.json's split and class names."""
    try:
        parsed = parse_npz(raw)
        prepared, drawn = npz_graph(parsed, seed=graph.split_seed)
    except ValueError as error:
        fail(f"{folder / fetch.GRAPH_FILE}: {' '.join(str(error).split())}. It is not a usable graph in the "
             f"gnn-benchmark npz format: fix the file at graphs.{name}.source, update graphs.{name}.sha256, and "
             f"run `dvc repro download@{name}`.")
    split = {"name": "pitfalls", "seed": graph.split_seed, "train_per_class": TRAIN_PER_CLASS,
             "val_per_class": VAL_PER_CLASS, "dropped_classes": dropped_summary(parsed, drawn)}
    return prepared, {"split": split, "class_names": kept_class_names(parsed, drawn)}


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True, help="a Planetoid dataset or a key of params.yaml's `graphs`")
    parser.add_argument("--raw", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.preprocess
    producer = f"download@{args.dataset}"
    expected = fetch.expected_files(params, args.dataset)
    source = params.graph(args.dataset)
    # Checksums before unpickling: only the pinned bytes are ever unpickled.
    raw = fetch.read_verified(require(args.raw, producer), expected, producer)
    extra: dict = {}
    if source is not None:
        graph, extra = _npz(raw[fetch.GRAPH_FILE], args.raw, args.dataset, source)
    else:
        graph = _parse(raw, args.raw, args.dataset)

    split_settings: dict = {"name": settings.split}
    if source is not None:
        split_settings = extra.pop("split")
    elif settings.split == "random":
        sizes = {"seed": settings.random_seed, "train_size": settings.random_train_size,
                 "val_size": settings.random_val_size, "test_size": settings.random_test_size}
        split_settings.update(sizes)
        try:
            graph = graph.with_split(random_split(graph.labels, **sizes))
        except ValueError as error:
            fail(f"{args.dataset}: {error}; lower preprocess.random_*_size in params.yaml.")
    meta = {"dataset": args.dataset, **describe(graph), "split": split_settings, "source_sha256": expected, **extra}
    tags = standard_tags(args.dataset, expected, split_seed=None if source is None else source.split_seed)

    with stage_run(DATA_EXPERIMENT, f"preprocess-{args.dataset}", tags=tags):
        mlflow.log_params({"dataset": args.dataset, **logged_params(params, "preprocess", args.dataset)})
        mlflow.log_metrics({"num_nodes": meta["num_nodes"], "num_features": meta["num_features"],
                            "num_classes": meta["num_classes"], "num_edges": meta["num_edges"],
                            **{f"{name}_nodes": part["count"] for name, part in meta["splits"].items()}})
        with atomic_dir(args.out) as staging:
            torch.save(graph_to_tensors(graph), staging / "graph.pt")
            write_json(staging / "meta.json", meta)
        mlflow.log_artifact(str(args.out / "meta.json"))
        log_dataset(args.dataset, redact(params.download.base_url if source is None else source.source), expected,
                    context="preprocess")
    counts = "/".join(str(part["count"]) for part in meta["splits"].values())
    print(f"{args.dataset}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, {meta['num_features']:,} "
          f"features, {meta['num_classes']} classes; {split_settings['name']} split {counts} -> {args.out}")
    if source is not None:
        dropped = split_settings["dropped_classes"]
        print(f"{args.dataset}: split seed {source.split_seed}; " + (
            "dropped classes with fewer than 50 nodes (now unlabelled, in no split): "
            + ", ".join(f"{name} ({count} nodes)" for name, count in dropped.items())
            if dropped else "no class has fewer than 50 nodes, none dropped"))


if __name__ == "__main__":
    main(run)
