"""Verify and parse one dataset's raw files, apply the split, and save the graph.

    python -m stages.preprocess --dataset cora --raw data/raw/cora --out data/prepared/cora

Writes `graph.pt` (gat.data.graph_to_tensors; torch.load(weights_only=True) reads it)
and `meta.json` (sizes, split settings, per-class counts, source checksums).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import mlflow
import torch

from gat.data import Graph, describe, graph_to_tensors, parse_planetoid, random_split
from gat.datasets import DATASETS
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


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--raw", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.preprocess
    producer = f"download@{args.dataset}"
    expected = fetch.pinned(args.dataset)
    # Checksums before unpickling: only the pinned bytes are ever unpickled.
    raw = fetch.read_verified(require(args.raw, producer), expected, producer)
    graph = _parse(raw, args.raw, args.dataset)

    split_settings: dict[str, str | int] = {"name": settings.split}
    if settings.split == "random":
        sizes = {"seed": settings.random_seed, "train_size": settings.random_train_size,
                 "val_size": settings.random_val_size, "test_size": settings.random_test_size}
        split_settings.update(sizes)
        try:
            graph = graph.with_split(random_split(graph.labels, **sizes))
        except ValueError as error:
            fail(f"{args.dataset}: {error}; lower preprocess.random_*_size in params.yaml.")
    meta = {"dataset": args.dataset, **describe(graph), "split": split_settings, "source_sha256": expected}

    with stage_run(DATA_EXPERIMENT, f"preprocess-{args.dataset}", tags=standard_tags(args.dataset, expected)):
        mlflow.log_params({"dataset": args.dataset, **logged_params(params, "preprocess", args.dataset)})
        mlflow.log_metrics({"num_nodes": meta["num_nodes"], "num_features": meta["num_features"],
                            "num_classes": meta["num_classes"], "num_edges": meta["num_edges"],
                            **{f"{name}_nodes": part["count"] for name, part in meta["splits"].items()}})
        with atomic_dir(args.out) as staging:
            torch.save(graph_to_tensors(graph), staging / "graph.pt")
            write_json(staging / "meta.json", meta)
        mlflow.log_artifact(str(args.out / "meta.json"))
        log_dataset(args.dataset, redact(params.download.base_url), expected, context="preprocess")
    counts = "/".join(str(part["count"]) for part in meta["splits"].values())
    print(f"{args.dataset}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, {meta['num_features']:,} "
          f"features, {meta['num_classes']} classes; {settings.split} split {counts} -> {args.out}")


if __name__ == "__main__":
    main(run)
