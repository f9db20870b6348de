"""End to end: the real `dvc repro` in a temporary git copy of the repo, with tiny params.

The data comes over a loopback HTTP server (GAT_DATA_MIRROR), the real Cora and Citeseer
files when ../shared has them, synthetic Planetoid-format files otherwise. MLflow uses the
copy's default store (`sqlite:///<copy>/mlflow.db`), which is what these tests inspect.
The tests run in file order and build on each other, like a user's session.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import mlflow
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from conftest import PlanetoidFolder, serving
from gat.config import Params, flatten
from stages._tracking import DATA_EXPERIMENT, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT, data_digest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
STAGES = ["download@cora", "download@citeseer", "preprocess@cora", "preprocess@citeseer", "train", "evaluate",
          "reproduce@cora", "reproduce@citeseer", "report"]

# Small enough to train in seconds; everything else is the repo's params.yaml.
TINY = {"train.max_epochs": 12, "train.patience": 4, "reproduce.seeds": 3, "reproduce.seeds_per_batch": 2,
        **{f"reproduce.hyperparameters.{name}.{key}": value for name in ("cora", "citeseer")
           for key, value in (("max_epochs", 12), ("patience", 4))}}


class Pipeline:
    """A throwaway clone of the project and the commands a user would type in it."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env
        self.client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")

    def run(self, *command: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        done = subprocess.run(command, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            pytest.fail(f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def dvc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(str(VENV_BIN / "dvc"), *args, check=check)

    def set_params(self, **dotted: object) -> None:
        params = yaml.safe_load((self.root / "params.yaml").read_text())
        for key, value in dotted.items():
            *parents, leaf = key.split(".")
            section = params
            for name in parents:
                section = section[name]
            section[leaf] = value
        (self.root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def params(self) -> Params:
        return Params.from_dict(yaml.safe_load((self.root / "params.yaml").read_text()))

    def runs(self, experiment: str) -> list:
        found = self.client.get_experiment_by_name(experiment)
        return [] if found is None else self.client.search_runs([found.experiment_id], order_by=["start_time ASC"])

    def all_runs(self) -> list:
        return [run for experiment in self.client.search_experiments() for run in self.runs(experiment.name)]

    def commit(self, message: str) -> None:
        self.run("git", "add", "-A")
        self.run("git", "commit", "-qm", message)


def ran(result: subprocess.CompletedProcess) -> list[str]:
    """The stages that `dvc repro` ran, in order."""
    return [line.split("'")[1] for line in result.stdout.splitlines() if line.startswith("Running stage")]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, planetoid_folder: PlanetoidFolder) -> Iterator[Pipeline]:
    root = tmp_path_factory.mktemp("gat-repro")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    for stale in ("dvc.lock",):
        (root / stale).unlink(missing_ok=True)
    if not planetoid_folder.real:
        # The pinned checksums are the real files'; synthetic data gets its own pinned list.
        shutil.copy(planetoid_folder.path / "SHA256SUMS", root / "stages/checksums/planetoid.sha256")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "GAT_"))}
    env |= {"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "MLFLOW_DISABLE_TELEMETRY": "true",
            "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
            "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"}
    pipeline = Pipeline(root, env)
    pipeline.set_params(**TINY)
    pipeline.run("git", "init", "-q", "-b", "main")
    pipeline.commit("copy of the project under test")
    with serving(planetoid_folder.path) as server:
        env["GAT_DATA_MIRROR"] = server.base_url
        pipeline.first = pipeline.dvc("repro")
        yield pipeline


def test_repro_runs_every_stage_and_logs_one_row_per_configuration(pipeline: Pipeline) -> None:
    assert sorted(ran(pipeline.first)) == sorted(STAGES)
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    assert row.info.status == "FINISHED"
    params = pipeline.params()
    expected = flatten({"datasets": params.datasets, "download": params.download, "preprocess": params.preprocess,
                        "model": params.model, "train": params.train})
    assert row.data.params == {key: str(value) for key, value in expected.items()}
    metrics = json.loads((pipeline.root / "data/eval/metrics.json").read_text())
    assert row.data.metrics["test_acc"] == pytest.approx(metrics["test_acc"])
    assert 0.0 < metrics["test_acc"] <= 1.0
    assert row.data.metrics["epochs"] <= TINY["train.max_epochs"]


def test_training_row_is_traceable_to_code_and_data(pipeline: Pipeline, planetoid_folder: PlanetoidFolder) -> None:
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    head = pipeline.run("git", "rev-parse", "HEAD").stdout.strip()
    cora = {name: sha for name, sha in planetoid_folder.checksums.items() if name.startswith("ind.cora.")}
    assert row.data.tags["git_commit"] == head
    assert row.data.tags["data_sha256"] == data_digest(cora)
    assert row.data.tags["dataset"] == "cora"
    (dataset_input,) = row.inputs.dataset_inputs
    assert dataset_input.dataset.name == "cora"
    assert dataset_input.dataset.digest == data_digest(cora)[:16]
    # The default store and its artifacts sit at the repository root.
    assert (pipeline.root / "mlflow.db").is_file()
    assert row.info.artifact_uri.startswith((pipeline.root / "mlartifacts").as_uri())


def test_data_stages_record_what_they_did(pipeline: Pipeline) -> None:
    runs = {run.info.run_name: run for run in pipeline.runs(DATA_EXPERIMENT)}
    assert sorted(runs) == ["download-citeseer", "download-cora", "preprocess-citeseer", "preprocess-cora"]
    assert all(run.info.status == "FINISHED" for run in runs.values())
    assert runs["download-cora"].data.params["source"] == pipeline.env["GAT_DATA_MIRROR"]
    meta = json.loads((pipeline.root / "data/prepared/cora/meta.json").read_text())
    assert runs["preprocess-cora"].data.metrics["num_nodes"] == meta["num_nodes"]


def test_logged_model_gives_the_pipeline_predictions(pipeline: Pipeline) -> None:
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    mlflow.set_tracking_uri(f"sqlite:///{pipeline.root / 'mlflow.db'}")
    uri = f"runs:/{row.info.run_id}/model"
    assert mlflow.models.get_model_info(uri).signature is not None
    model = mlflow.pytorch.load_model(uri)
    lines = (pipeline.root / "data/eval/predictions.csv").read_text().splitlines()[1:]
    nodes, _actual, predicted = zip(*(map(int, line.split(",")) for line in lines))
    assert model(torch.tensor(nodes)).argmax(-1).tolist() == list(predicted)


def test_dvc_metrics_and_plots_show(pipeline: Pipeline) -> None:
    shown = json.loads(pipeline.dvc("metrics", "show", "--json").stdout)
    (workspace,) = shown.values() if "workspace" not in shown else [shown["workspace"]]
    assert "test_acc" in json.dumps(workspace)
    plots = json.loads(pipeline.dvc("plots", "show", "--json").stdout)
    assert not plots.get("errors")
    assert set(plots["data"]) == {"Loss per epoch", "Accuracy per epoch", "Test confusion matrix",
                                  "data/reproduce/cora/histogram.csv", "data/reproduce/citeseer/histogram.csv"}
    epochs = plots["data"]["Loss per epoch"][0]["content"]["data"]["values"]
    assert len(epochs) >= len({row["epoch"] for row in epochs}) > 1


def test_reproduce_reports_every_dataset_beside_the_paper(pipeline: Pipeline) -> None:
    shown = json.loads(pipeline.dvc("metrics", "show", "--json").stdout)
    metrics = json.loads((pipeline.root / "reports/reproduction.json").read_text())
    assert "reports/reproduction.json" in json.dumps(shown)
    report = (pipeline.root / "reports/reproduction.md").read_text()
    for name in ("cora", "citeseer"):
        seeds = (pipeline.root / f"data/reproduce/{name}/seeds.csv").read_text().splitlines()[1:]
        accuracies = [float(line.split(",")[1]) for line in seeds]
        assert metrics[name]["seeds"] == len(accuracies) == TINY["reproduce.seeds"]
        assert metrics[name]["test_acc_mean"] == pytest.approx(sum(accuracies) / len(accuracies))
        assert metrics[name]["test_acc_min"] <= metrics[name]["test_acc_mean"] <= metrics[name]["test_acc_max"]
        assert metrics[name]["paper_test_acc_mean"] in (0.830, 0.725)
        assert f"| {name} | {len(accuracies)} |" in report


def test_reproduce_logs_a_parent_per_dataset_and_a_child_per_seed(pipeline: Pipeline) -> None:
    runs = pipeline.runs(REPRODUCE_EXPERIMENT)
    parents = {run.data.tags["dataset"]: run for run in runs if "mlflow.parentRunId" not in run.data.tags}
    assert sorted(parents) == ["citeseer", "cora"]
    head = pipeline.run("git", "rev-parse", "HEAD").stdout.strip()
    for name, parent in parents.items():
        children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(int(run.data.params["seed"]) for run in children) == [0, 1, 2]
        for run in [parent, *children]:
            assert run.info.status == "FINISHED"
            assert run.data.tags["git_commit"] == head and run.data.tags["dataset"] == name
            assert run.data.tags["data_sha256"] == parent.data.tags["data_sha256"]
        mean = sum(run.data.metrics["test_acc"] for run in children) / 3
        assert parent.data.metrics["test_acc_mean"] == pytest.approx(mean)
        artifacts = {item.path for item in pipeline.client.list_artifacts(parent.info.run_id)}
        assert {"report.md", "test_acc_histogram.png"} <= artifacts


def test_a_seed_gives_the_same_result_alone_and_in_a_batch(pipeline: Pipeline, tmp_path: Path) -> None:
    baseline = (pipeline.root / "data/reproduce/cora/seeds.csv").read_text().splitlines()
    original = (pipeline.root / "params.yaml").read_text()
    try:  # one seed per batch on one worker, and all three in one batch: the per-seed rows must not change
        for per_batch, workers in ((1, 1), (3, 2)):
            pipeline.set_params(**{"reproduce.seeds_per_batch": per_batch, "reproduce.workers": workers})
            out = tmp_path / f"{per_batch}-{workers}"
            pipeline.run(str(VENV_BIN / "python"), "-m", "stages.reproduce", "--dataset", "cora",
                         "--data", "data/prepared/cora", "--out", str(out))
            assert (out / "seeds.csv").read_text().splitlines() == baseline
    finally:
        (pipeline.root / "params.yaml").write_text(original)


def test_second_repro_is_a_noop(pipeline: Pipeline) -> None:
    before = len(pipeline.all_runs())
    assert ran(pipeline.dvc("repro")) == []
    assert len(pipeline.all_runs()) == before


def test_changing_train_lr_reruns_only_train_and_evaluate(pipeline: Pipeline) -> None:
    pipeline.set_params(**{"train.lr": 0.01})
    assert ran(pipeline.dvc("repro")) == ["train", "evaluate"]
    first, second = pipeline.runs(TRAIN_EXPERIMENT)
    assert (first.data.params["train.lr"], second.data.params["train.lr"]) == ("0.005", "0.01")
    assert "test_acc" in second.data.metrics


def test_rerunning_only_evaluate_completes_the_same_row(pipeline: Pipeline) -> None:
    before = [run.info.run_id for run in pipeline.all_runs()]
    assert ran(pipeline.dvc("repro", "--force", "--single-item", "evaluate")) == ["evaluate"]
    assert [run.info.run_id for run in pipeline.all_runs()] == before
    assert pipeline.runs(TRAIN_EXPERIMENT)[-1].info.status == "FINISHED"


def test_exp_run_lands_as_its_own_row_tagged_with_the_experiment(pipeline: Pipeline) -> None:
    pipeline.commit("lr 0.01")
    pipeline.dvc("exp", "run", "-S", "train.lr=0.02", "-n", "lr-002")
    newest = pipeline.runs(TRAIN_EXPERIMENT)[-1]
    assert newest.data.tags["dvc_exp_name"] == "lr-002"
    assert newest.data.params["train.lr"] == "0.02"
    assert "test_acc" in newest.data.metrics
    pipeline.dvc("exp", "apply", "lr-002")  # leave the workspace consistent for the next tests


def test_bad_param_fails_before_any_work(pipeline: Pipeline) -> None:
    before = len(pipeline.all_runs())
    original = (pipeline.root / "params.yaml").read_text()
    try:
        for key, value, says in [("train.lr", "fast", "must be a number"), ("model.dropout", 1.5, "must be in"),
                                 ("train.lrr", 0.1, "is not a known key")]:
            pipeline.set_params(**{key: value})
            failed = pipeline.dvc("repro", check=False)
            assert failed.returncode != 0
            assert f"`{key}` {says}" in failed.stdout + failed.stderr
            (pipeline.root / "params.yaml").write_text(original)
    finally:
        (pipeline.root / "params.yaml").write_text(original)
    assert len(pipeline.all_runs()) == before


def test_missing_upstream_output_names_the_stage_to_run(pipeline: Pipeline, tmp_path: Path) -> None:
    failed = pipeline.run(str(VENV_BIN / "python"), "-m", "stages.train", "--data", "data/prepared/nowhere",
                          "--out", str(tmp_path), check=False)
    assert failed.returncode == 2
    assert "dvc repro preprocess@cora" in failed.stderr


def test_interrupted_training_is_marked_failed_and_writes_nothing(pipeline: Pipeline, tmp_path: Path) -> None:
    original = (pipeline.root / "params.yaml").read_text()
    pipeline.set_params(**{"train.max_epochs": 100000, "train.patience": 100000})
    try:
        process = subprocess.Popen([str(VENV_BIN / "python"), "-m", "stages.train", "--data", "data/prepared/cora",
                                    "--out", str(tmp_path / "out")], cwd=pipeline.root, env=pipeline.env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not any(run.info.status == "RUNNING" for run in pipeline.runs(TRAIN_EXPERIMENT)):
            assert process.poll() is None and time.monotonic() < deadline, "training never started a run"
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) != 0
    finally:
        (pipeline.root / "params.yaml").write_text(original)
    statuses = [run.info.status for run in pipeline.runs(TRAIN_EXPERIMENT)]
    assert statuses[-1] == "FAILED" and "RUNNING" not in statuses
    assert not (tmp_path / "out").exists()
