"""stages.report: every dataset of the registry has a row, the ones not run here with the paper's figure alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_stage_in_process

from benchmarks.scale import set_params
from gat.datasets import DATASETS
from gat.reproduction import summarise
from stages import report

REPO = Path(__file__).resolve().parents[1]


def _summary(dataset: str, accuracies: list[float]) -> dict:
    """A reproduce stage's summary.json, of the keys the report reads."""
    paper = DATASETS[dataset].paper
    test = vars(summarise(accuracies))
    return {"dataset": dataset, "seeds": len(accuracies), "test": test, "val": vars(summarise(accuracies[::-1])),
            "epochs": vars(summarise([200.0, 300.0])), "paper": vars(paper),
            "protocol": {"optim": {"lr": 0.005, "weight_decay": 0.0005, "patience": 100}},
            "inside_paper_band": paper.contains(test["mean"])}


def _report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, summaries: list[dict]) -> tuple[str, dict]:
    for summary in summaries:
        folder = tmp_path / "data/reproduce" / summary["dataset"]
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(summary))
    monkeypatch.chdir(tmp_path)
    code = run_stage_in_process(monkeypatch, "stages.report", report.run, "--reproduced", "data/reproduce",
                                "--markdown", "report.md", "--metrics", "report.json")
    assert code == 0
    return (tmp_path / "report.md").read_text(), json.loads((tmp_path / "report.json").read_text())


def test_pubmed_not_run_here_shows_the_papers_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")  # datasets: [cora, citeseer]
    table, metrics = _report(tmp_path, monkeypatch, [_summary("cora", [0.83, 0.832]),
                                                     _summary("citeseer", [0.72, 0.724])])
    rows = [line for line in table.splitlines() if line.startswith("| ") and "accuracy" not in line]
    assert [row.split(" | ")[0] for row in rows[:3]] == ["| cora", "| citeseer", "| pubmed"]
    assert rows[2] == "| pubmed | – | not run here | – | – | 79.00 ± 0.30 % | – | – |"
    assert "Not run here: pubmed" in table
    assert sorted(metrics) == ["citeseer", "cora"]  # nothing measured on pubmed, no metrics


def test_a_pubmed_reproduction_replaces_the_not_run_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    set_params(tmp_path, datasets=["cora", "pubmed"], **{"train.dataset": "cora"})
    table, metrics = _report(tmp_path, monkeypatch, [_summary("cora", [0.83, 0.832]),
                                                     _summary("pubmed", [0.79, 0.788])])
    assert "| pubmed | 2 | 78.90 ± 0.14 % |" in table and "| pubmed | – |" not in table
    assert "| citeseer | – | not run here |" in table
    assert metrics["pubmed"]["paper_test_acc_mean"] == 0.790 and metrics["pubmed"]["seeds"] == 2
