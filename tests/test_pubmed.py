"""Pubmed end to end, on synthetic files of its shape: the real `ind.pubmed.allx` is out of reach (README, "Pubmed").

The stages run in this process as `python -m stages.<stage>` would, in a scratch folder whose params.yaml lists
`pubmed`: download (from a loopback server, the synthetic files' checksums and sizes pinned), preprocess (Pubmed's
sizes and split), train and evaluate a few epochs with the paper's Pubmed protocol, reproduce two seeds, report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import mlflow
import pytest
import torch
from conftest import LoopbackServer, run_stage_in_process, write_synthetic_planetoid

from benchmarks.scale import set_params
from gat import datasets
from gat.data import graph_from_tensors
from stages import download, evaluate, preprocess, report, reproduce, train
from stages.support.params import load_params
from stages.support.store import REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT

REPO = Path(__file__).resolve().parents[1]

# Pubmed's shape (PyG's Planetoid("Pubmed") counts): 19,717 nodes, 500 TF-IDF features, 3 classes, 88,648 directed
# edges (44,324 undirected), the standard 60/500/1,000 split. 60 + 500 + 18,157 + 1,000 = 19,717 nodes.
PUBMED_SHAPE = dict(num_classes=datasets.DATASETS["pubmed"].num_classes, num_features=500, num_extra=18_157,
                    num_test=1000, missing_test=0, num_edges=44_324, tfidf=True, seed=3)


@pytest.mark.slow  # about 20 s alone: a graph of Pubmed's size, through every stage
def test_the_pubmed_chain_on_synthetic_files_of_its_shape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, serve_folder: Callable[..., LoopbackServer],
        capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "served"
    write_synthetic_planetoid(raw, "pubmed", **PUBMED_SHAPE)
    monkeypatch.setattr(datasets, "CHECKSUMS", raw / "SHA256SUMS")
    monkeypatch.setattr(datasets, "SIZES", raw / "SIZES")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "params.yaml", work / "params.yaml")
    tiny = {"max_epochs": 3, "patience": 2}
    set_params(work, datasets=["pubmed"], **{"train.dataset": "pubmed", "reproduce.seeds": 2,
                                             "reproduce.seeds_per_batch": 1, "reproduce.workers": 1,
                                             **{f"reproduce.protocol.pubmed.optim.{k}": v for k, v in tiny.items()}})
    # A user's Pubmed training run takes the paper's Pubmed protocol, as reproduce.protocol.pubmed writes it.
    protocol = load_params(work / "params.yaml").reproduce.protocol["pubmed"]
    set_params(work, **{f"train.model.{key}": getattr(protocol.model, key) for key in ("output_heads",)},
               **{f"train.optim.{key}": getattr(protocol.optim, key) for key in ("lr", "weight_decay", *tiny)})
    assert load_params(work / "params.yaml").train.setup == protocol
    monkeypatch.chdir(work)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("GAT_DATA_MIRROR", serve_folder(raw).base_url)

    def stage(module, *args: str) -> str:
        assert run_stage_in_process(monkeypatch, module.__name__, module.run, *args) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    stage(download, "--dataset", "pubmed", "--out", "data/raw/pubmed")
    assert sorted(path.name for path in (work / "data/raw/pubmed").iterdir()) == sorted(datasets.file_names("pubmed"))

    said = stage(preprocess, "--dataset", "pubmed", "--raw", "data/raw/pubmed", "--out", "data/prepared/pubmed")
    assert "pubmed: 19,717 nodes, 44,324 edges, 500 features, 3 classes; standard split 60/500/1000" in said
    meta = json.loads((work / "data/prepared/pubmed/meta.json").read_text())
    assert (meta["num_nodes"], meta["num_features"], meta["num_classes"]) == (19_717, 500, 3)
    assert {name: part["count"] for name, part in meta["splits"].items()} == {"train": 60, "val": 500, "test": 1000}
    assert meta["splits"]["train"]["per_class"] == [20, 20, 20]
    graph = graph_from_tensors(torch.load(work / "data/prepared/pubmed/graph.pt", weights_only=True))
    assert graph.edge_index.shape == (2, 88_648) and graph.features.shape == (19_717, 500)

    stage(train, "--data", "data/prepared/pubmed", "--out", "data/train")
    run = json.loads((work / "data/train/run.json").read_text())
    assert 1 <= run["epochs"] <= tiny["max_epochs"]
    stage(evaluate, "--data", "data/prepared/pubmed", "--train", "data/train", "--out", "data/eval")
    evaluated = json.loads((work / "data/eval/metrics.json").read_text())
    assert 0.0 <= evaluated["test_acc"] <= 1.0
    per_class = json.loads((work / "data/eval/per_class.json").read_text())
    assert set(datasets.DATASETS["pubmed"].class_names) <= set(json.dumps(per_class).replace('"', " ").split())

    stage(reproduce, "--dataset", "pubmed", "--data", "data/prepared/pubmed", "--out", "data/reproduce/pubmed")
    summary = json.loads((work / "data/reproduce/pubmed/summary.json").read_text())
    assert summary["seeds"] == 2 and summary["paper"] == {"mean": 0.790, "std": 0.003}
    assert summary["protocol"]["model"]["output_heads"] == 8 and summary["protocol"]["optim"]["lr"] == 0.01
    # The fused kernel serves 8 output heads: neither stage fell back to the torch kernel.
    (trained,) = mlflow.search_runs(experiment_names=[TRAIN_EXPERIMENT], output_format="list")
    assert trained.data.tags["training_kernel"] == "fused"
    parents = [run for run in mlflow.search_runs(experiment_names=[REPRODUCE_EXPERIMENT], output_format="list")
               if "mlflow.parentRunId" not in run.data.tags]
    assert [run.data.tags["training_kernels"] for run in parents] == ["fused"]

    stage(report, "--reproduced", "data/reproduce", "--markdown", "reports/reproduction.md",
          "--metrics", "reports/reproduction.json")
    table = (work / "reports/reproduction.md").read_text()
    assert "| pubmed | 2 |" in table and "| 79.00 ± 0.30 % |" in table
    assert "| cora | – | not run here |" in table and "| citeseer | – | not run here |" in table
    assert list(json.loads((work / "reports/reproduction.json").read_text())) == ["pubmed"]
