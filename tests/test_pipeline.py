"""End to end: the real `dvc repro` in a temporary git copy of the repo, with tiny params.

Tests that only look use the session's `pipeline`; tests that change params, rerun or interrupt stages
use a private `pipeline_copy` of it (tests/pipeline_support.py), so they run in any order.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from markdown_support import markdown_problems
from pipeline_support import DATASETS, TINY, VENV_BIN, Pipeline, ran

from gat.config import flatten
from stages.support.store import DATA_EXPERIMENT, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT
from stages.support.tracking import data_digest

STAGES = [f"{stage}@{name}" for stage in ("download", "preprocess", "reproduce") for name in DATASETS] + [
    "train", "evaluate", "analyze", "report"]


def test_repro_runs_every_stage_and_logs_one_row_per_configuration(pipeline: Pipeline) -> None:
    assert sorted(ran(pipeline.first)) == sorted(STAGES)
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    assert row.info.status == "FINISHED"
    params = pipeline.params()
    expected = flatten({"datasets": params.datasets, "download": params.download, "preprocess": params.preprocess,
                        "train": params.train})
    assert row.data.params == {key: str(value) for key, value in expected.items()}
    metrics = json.loads((pipeline.root / "data/eval/metrics.json").read_text())
    assert 0.0 < metrics["test_acc"] <= 1.0
    assert row.data.metrics["epochs"] <= TINY["train.optim.max_epochs"]


def test_training_row_is_traceable_to_code_and_data(pipeline: Pipeline, planetoid_folder) -> None:
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    first = pipeline.run("git", "rev-parse", "HEAD~1").stdout.strip()  # the commit `dvc repro` ran on
    cora = {name: sha for name, sha in planetoid_folder.checksums.items() if name.startswith("ind.cora.")}
    assert row.data.tags["git_commit"] == first
    assert row.data.tags["data_sha256"] == data_digest(cora)
    assert row.data.tags["dataset"] == "cora"
    assert row.data.tags["training_kernel"] == "fused"  # the kernel that ran, not only the param asked for it
    (dataset_input,) = row.inputs.dataset_inputs
    assert dataset_input.dataset.name == "cora"
    assert dataset_input.dataset.digest == data_digest(cora)[:16]
    # The default store and its artifacts sit at the repository root.
    assert (pipeline.root / "mlflow.db").is_file()
    assert row.info.artifact_uri.startswith((pipeline.root / "mlartifacts").as_uri())


def test_data_stages_record_what_they_did(pipeline: Pipeline) -> None:
    runs = {run.info.run_name: run for run in pipeline.runs(DATA_EXPERIMENT)}
    assert sorted(runs) == sorted(f"{stage}-{name}" for stage in ("download", "preprocess") for name in DATASETS)
    assert all(run.info.status == "FINISHED" for run in runs.values())
    assert runs["download-cora"].data.params["source"] == pipeline.env["GAT_DATA_MIRROR"]
    meta = json.loads((pipeline.root / "data/prepared/cora/meta.json").read_text())
    assert runs["preprocess-cora"].data.metrics["num_nodes"] == meta["num_nodes"]


def test_the_ui_shows_the_restored_models_metrics(pipeline: Pipeline) -> None:
    """What MLflow's runs table and run page show (get_run) is what `dvc metrics show` shows."""
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    metrics = json.loads((pipeline.root / "data/eval/metrics.json").read_text())
    assert metrics["best_epoch"] < metrics["epochs"], "the test needs a run whose last epoch is not the restored one"
    shown = pipeline.client.get_run(row.info.run_id).data.metrics
    assert {key: shown[key] for key in metrics} == pytest.approx(metrics)
    history = _history(pipeline)
    # The per-epoch curves hold only epochs, under their own names: no step-0 point, one point per epoch.
    curve = pipeline.client.get_metric_history(row.info.run_id, "epoch_val_acc")
    assert sorted(point.step for point in curve) == [int(r["epoch"]) for r in history]
    assert [point.value for point in sorted(curve, key=lambda p: p.step)][-1] == pytest.approx(history[-1]["val_acc"])
    assert len(pipeline.client.get_metric_history(row.info.run_id, "val_acc")) == 1


def _history(pipeline: Pipeline) -> list[dict]:
    lines = (pipeline.root / "data/train/history.csv").read_text().splitlines()
    header = lines[0].split(",")
    return [dict(zip(header, map(float, line.split(",")))) for line in lines[1:]]


def test_top_level_metrics_are_few_and_plainly_named(pipeline: Pipeline) -> None:
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    curves = {f"epoch_{key}" for key in ("train_loss", "train_acc", "val_loss", "val_acc")}
    analysis = {"attention_entropy_layer1", "attention_entropy_layer2", "attention_entropy_uniform",
                "silhouette_layer1", "silhouette_tsne"}  # the analyze stage's
    assert set(row.data.metrics) == {"test_acc", "val_acc", "test_macro_f1", "test_loss", "val_loss", "epochs",
                                     "best_epoch"} | curves | analysis
    artifacts = {item.path for item in pipeline.client.list_artifacts(row.info.run_id)}
    assert {"per_class.json", "per_class_table.json", "confusion_matrix.json"} <= artifacts
    # Each metric comes from one stage, once: epochs and best_epoch from train, not again from evaluate.
    logged = {key: len(pipeline.client.get_metric_history(row.info.run_id, key)) for key in row.data.metrics
              if key not in curves}
    assert logged == dict.fromkeys(logged, 1)


def test_experiments_open_in_model_training_mode_with_descriptions(pipeline: Pipeline) -> None:
    for name in (TRAIN_EXPERIMENT, DATA_EXPERIMENT, REPRODUCE_EXPERIMENT):
        experiment = pipeline.client.get_experiment_by_name(name)
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
        assert len(experiment.tags["mlflow.note.content"]) > 40
        # The runs table opens on the important columns (ui_url's view), and each of them is really logged.
        view = json.loads(experiment.tags["mlflow.sharedViewState.main"])
        runs = pipeline.runs(name)
        logged = {f"metrics.`{key}`" for run in runs for key in run.data.metrics} | {
            f"params.`{key}`" for run in runs for key in run.data.params} | {
            f"tags.`{key}`" for run in runs for key in run.data.tags}
        assert set(view["selectedColumns"]) - {"tags.`dvc_exp_name`"} <= logged
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    assert "All params as committed" in row.data.tags["mlflow.note.content"]
    parents = [run for run in pipeline.runs(REPRODUCE_EXPERIMENT) if "mlflow.parentRunId" not in run.data.tags]
    assert all("mlflow.note.content" in run.data.tags for run in parents)
    # MLflow's Compare page opens its parallel-coordinates plot on the first metric the first run logged.
    assert all(next(iter(run.data.metrics)) == "test_acc_mean" for run in parents)
    # Every description the UI shows renders as written (Markdown): the experiments', the runs', the models'.
    notes = [pipeline.client.get_experiment_by_name(name).tags["mlflow.note.content"]
             for name in (TRAIN_EXPERIMENT, DATA_EXPERIMENT, REPRODUCE_EXPERIMENT)]
    notes += [run.data.tags["mlflow.note.content"] for name in (TRAIN_EXPERIMENT, REPRODUCE_EXPERIMENT)
              for run in pipeline.runs(name) if "mlflow.note.content" in run.data.tags]
    notes += [model.description for model in pipeline.client.search_registered_models()]
    assert {note: markdown_problems(note) for note in notes} == dict.fromkeys(notes, [])


def test_confusion_matrix_and_curves_are_pictures(pipeline: Pipeline, tmp_path: Path) -> None:
    import matplotlib.image

    from stages.support.figures import class_names

    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    for name in ("analysis/confusion_matrix.png", "training_curves.png"):
        local = pipeline.client.download_artifacts(row.info.run_id, name, str(tmp_path))
        image = matplotlib.image.imread(local)
        assert image.shape[0] > 300 and image.shape[1] > 300 and image.std() > 0.05  # a real, non-blank picture
    confusion = json.loads(Path(pipeline.client.download_artifacts(row.info.run_id, "confusion_matrix.json",
                                                                    str(tmp_path))).read_text())
    assert confusion["names"] == class_names("cora", len(confusion["labels"]))
    assert "Neural_Networks" in confusion["names"]


def test_logged_model_loads_from_anywhere_and_gives_the_pipeline_predictions(pipeline: Pipeline,
                                                                             tmp_path: Path) -> None:
    """The README's snippet, run outside the repository with the store named by MLFLOW_TRACKING_URI."""
    (row,) = pipeline.runs(TRAIN_EXPERIMENT)
    lines = (pipeline.root / "data/eval/predictions.csv").read_text().splitlines()[1:]
    nodes, _actual, predicted = zip(*(map(int, line.split(",")) for line in lines))
    snippet = ("import json, sys, mlflow\n"
               f"model = mlflow.pyfunc.load_model('runs:/{row.info.run_id}/gat-cora')\n"
               f"print(json.dumps(model.predict({list(nodes)}).argmax(-1).tolist()))\n")
    # TMPDIR: MLflow downloads the model into a temporary folder of its own and leaves it there.
    env = pipeline.env | {"MLFLOW_TRACKING_URI": pipeline.tracking_uri, "TMPDIR": str(tmp_path)}
    done = subprocess.run([str(VENV_BIN / "python"), "-c", snippet], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == list(predicted)


def test_the_best_configuration_is_the_registered_champion(pipeline_copy: Pipeline) -> None:
    import mlflow

    from stages.support.champion import promote_if_champion

    (row,) = pipeline_copy.runs(TRAIN_EXPERIMENT)
    champion = pipeline_copy.client.get_model_version_by_alias("gat-cora", "champion")
    assert champion.run_id == row.info.run_id
    run = json.loads((pipeline_copy.root / "data/train/run.json").read_text())
    val_acc = row.data.metrics["val_acc"]
    mlflow.set_tracking_uri(pipeline_copy.tracking_uri)
    try:
        # A worse (or equal) configuration leaves the alias; a better one takes it.
        promote_if_champion("another-run", "gat-cora", run["model_uri"], val_acc)
        assert pipeline_copy.client.get_model_version_by_alias("gat-cora", "champion").version == champion.version
        promote_if_champion("another-run", "gat-cora", run["model_uri"], val_acc + 0.01)
        moved = pipeline_copy.client.get_model_version_by_alias("gat-cora", "champion")
        assert int(moved.version) > int(champion.version) and float(moved.tags["val_acc"]) == val_acc + 0.01
    finally:
        mlflow.set_tracking_uri(None)


def test_dvc_metrics_and_plots_show(pipeline: Pipeline) -> None:
    shown = json.loads(pipeline.dvc("metrics", "show", "--json").stdout)
    (workspace,) = shown.values() if "workspace" not in shown else [shown["workspace"]]
    assert "test_acc" in json.dumps(workspace)
    plots = json.loads(pipeline.dvc("plots", "show", "--json").stdout)
    assert not plots.get("errors")
    assert set(plots["data"]) == {"Loss per epoch", "Accuracy per epoch", "Test confusion matrix"} | {
        f"data/reproduce/{name}/histogram.csv" for name in DATASETS} | {
        f"data/analysis/{name}.png" for name in ("attention_entropy", "embedding_tsne", "neighbourhoods",
                                                 "training_curves", "confusion_matrix")}
    epochs = plots["data"]["Loss per epoch"][0]["content"]["data"]["values"]
    assert len(epochs) >= len({row["epoch"] for row in epochs}) > 1


def test_reproduce_reports_every_dataset_beside_the_paper(pipeline: Pipeline) -> None:
    shown = json.loads(pipeline.dvc("metrics", "show", "--json").stdout)
    metrics = json.loads((pipeline.root / "reports/reproduction.json").read_text())
    assert "reports/reproduction.json" in json.dumps(shown)
    report = (pipeline.root / "reports/reproduction.md").read_text()
    for name in DATASETS:
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
    assert sorted(parents) == sorted(DATASETS)
    first = pipeline.run("git", "rev-parse", "HEAD~1").stdout.strip()
    seeds = list(range(TINY["reproduce.seeds"]))
    for name, parent in parents.items():
        children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(int(run.data.params["seed"]) for run in children) == seeds
        assert sorted(run.info.run_name for run in children) == sorted(f"{name}-seed-{seed}" for seed in seeds)
        for run in [parent, *children]:
            assert run.info.status == "FINISHED"
            assert run.data.tags["git_commit"] == first and run.data.tags["dataset"] == name
            assert run.data.tags["data_sha256"] == parent.data.tags["data_sha256"]
        for child in children:  # each seed's real training time, inside its parent's
            assert parent.info.start_time <= child.info.start_time < child.info.end_time <= parent.info.end_time
        mean = sum(run.data.metrics["test_acc"] for run in children) / len(children)
        assert parent.data.metrics["test_acc_mean"] == pytest.approx(mean)
        # One name per metric: the parent's MLflow metrics are named as reports/reproduction.json names them.
        reported = json.loads((pipeline.root / "reports/reproduction.json").read_text())[name]
        for key in ("test_acc_ci95_low", "test_acc_ci95_high", "val_acc_ci95_low", "val_acc_ci95_high"):
            assert parent.data.metrics[key] == pytest.approx(reported[key])
        artifacts = {item.path for item in pipeline.client.list_artifacts(parent.info.run_id)}
        assert {"report.md", "test_acc_histogram.png"} <= artifacts


def test_reproduce_parent_params_are_params_yaml_keys_without_float_noise(pipeline: Pipeline) -> None:
    dotted = set(flatten(pipeline.params()))
    parents = [run for run in pipeline.runs(REPRODUCE_EXPERIMENT) if "mlflow.parentRunId" not in run.data.tags]
    for parent in parents:
        assert set(parent.data.params) <= dotted
        assert int(parent.data.tags["workers_resolved"]) >= 1
        for key, value in parent.data.metrics.items():
            assert value == float(f"{value:.12g}"), f"{key} = {value!r} carries float noise"


def test_a_seed_gives_the_same_result_alone_and_in_a_batch(pipeline_copy: Pipeline, tmp_path: Path) -> None:
    baseline = (pipeline_copy.root / "data/reproduce/cora/seeds.csv").read_text().splitlines()
    # one seed per batch on one worker, and all three in one batch: the per-seed rows must not change
    for per_batch, workers in ((1, 1), (3, 2)):
        pipeline_copy.set_params(**{"reproduce.seeds_per_batch": per_batch, "reproduce.workers": workers})
        out = tmp_path / f"{per_batch}-{workers}"
        pipeline_copy.python("-m", "stages.reproduce", "--dataset", "cora", "--data", "data/prepared/cora",
                             "--out", str(out))
        assert (out / "seeds.csv").read_text().splitlines() == baseline


def test_second_repro_is_a_noop(pipeline_copy: Pipeline) -> None:
    before = len(pipeline_copy.all_runs())
    assert ran(pipeline_copy.dvc("repro")) == []
    assert len(pipeline_copy.all_runs()) == before


def test_changing_train_lr_reruns_only_train_evaluate_and_analyze(pipeline_copy: Pipeline) -> None:
    pipeline_copy.set_params(**{"train.optim.lr": 0.01})
    stages = ran(pipeline_copy.dvc("repro"))
    assert stages[0] == "train" and sorted(stages[1:]) == ["analyze", "evaluate"]
    first, second = pipeline_copy.runs(TRAIN_EXPERIMENT)
    assert (first.data.params["train.optim.lr"], second.data.params["train.optim.lr"]) == ("0.005", "0.01")
    assert "test_acc" in second.data.metrics
    assert "`train.optim.lr`: `0.01` (committed: `0.005`)" in second.data.tags["mlflow.note.content"]


def test_changing_one_datasets_protocol_reruns_only_its_reproduction(pipeline_copy: Pipeline) -> None:
    pipeline_copy.set_params(**{"reproduce.protocol.cora.optim.lr": 0.01})
    assert ran(pipeline_copy.dvc("repro")) == ["reproduce@cora", "report"]


def test_rerunning_only_evaluate_completes_the_same_row(pipeline_copy: Pipeline) -> None:
    before = [run.info.run_id for run in pipeline_copy.all_runs()]
    assert ran(pipeline_copy.dvc("repro", "--force", "--single-item", "evaluate")) == ["evaluate"]
    assert [run.info.run_id for run in pipeline_copy.all_runs()] == before
    assert pipeline_copy.runs(TRAIN_EXPERIMENT)[-1].info.status == "FINISHED"


def test_a_temporary_exp_run_is_its_own_row_and_leaves_params_yaml_alone(pipeline_copy: Pipeline) -> None:
    """The README's side run: `dvc exp run --temp -S ...` (plain `dvc exp run` applies the result to the workspace)."""
    before = (pipeline_copy.root / "params.yaml").read_text()
    pipeline_copy.dvc("exp", "run", "--temp", "-S", "train.optim.lr=0.02", "-n", "lr-002")
    assert (pipeline_copy.root / "params.yaml").read_text() == before
    newest = pipeline_copy.runs(TRAIN_EXPERIMENT)[-1]
    assert newest.data.tags["dvc_exp_name"] == "lr-002"
    assert newest.data.params["train.optim.lr"] == "0.02"
    assert "test_acc" in newest.data.metrics
    assert "train.optim.lr" in newest.data.tags["mlflow.note.content"]
    # Its artifacts land in the repository's store, not in the temporary copy DVC ran it in.
    assert newest.info.artifact_uri.startswith((pipeline_copy.root / "mlartifacts").as_uri())


def test_make_exps_shows_what_an_experiment_changed_and_what_it_did(pipeline_copy: Pipeline) -> None:
    """The README's first screen after `dvc exp run -S train.optim.lr=0.01`: `make exps` (tools.exps)."""
    pipeline_copy.dvc("exp", "run", "-S", "train.optim.lr=0.01", "-n", "lr-001")
    shown = pipeline_copy.python("-m", "tools.exps").stdout.splitlines()
    metrics = json.loads((pipeline_copy.root / "data/eval/metrics.json").read_text())  # the experiment's
    header, workspace, baseline, experiment = shown
    assert header.split()[:4] == ["experiment", "test_acc", "val_acc", "epochs"]
    assert workspace.startswith("workspace") and workspace.endswith("train.optim.lr=0.01")
    assert baseline.startswith("main (") and "=" not in baseline
    cells = experiment.split()
    assert cells[0] == "lr-001" and cells[-1] == "train.optim.lr=0.01"  # the one param changed, nothing else
    assert cells[1:4] == [f"{metrics['test_acc']:.4f}", f"{metrics['val_acc']:.4f}", str(metrics["epochs"])]
    assert all(len(line) <= 120 for line in shown)


def test_a_clean_run_prints_stage_lines_progress_and_results(pipeline: Pipeline) -> None:
    """Off a terminal (dvc's output to a file), each reproduction says how far it is; registering the first
    model in a brand-new store prints none of MLflow's registry lines, nor a download bar."""
    shown = pipeline.first.stdout + pipeline.first.stderr
    for name in DATASETS:
        progress = [line for line in shown.splitlines() if line.startswith(f"reproduce {name}: ")]
        assert progress and progress[-1].startswith(f"reproduce {name}: {TINY['reproduce.seeds']}/"
                                                     f"{TINY['reproduce.seeds']} seeds (100 %), "), shown
    assert "registered as gat-cora version 1, now `champion`" in shown
    for noise in ("already exists", "Created version", "Successfully registered", "Waiting up to",
                  "Downloading artifacts"):
        assert noise not in shown


def test_bad_param_fails_before_any_work(pipeline_copy: Pipeline) -> None:
    before = len(pipeline_copy.all_runs())
    original = (pipeline_copy.root / "params.yaml").read_text()
    for key, value, says in [("train.optim.lr", "fast", "must be a number"),
                             ("train.model.dropout", 1.5, "must be in"), ("train.lrr", 0.1, "is not a known key")]:
        pipeline_copy.set_params(**{key: value})
        failed = pipeline_copy.dvc("repro", check=False)
        assert failed.returncode != 0
        assert f"`{key}` {says}" in failed.stdout + failed.stderr
        (pipeline_copy.root / "params.yaml").write_text(original)
    assert len(pipeline_copy.all_runs()) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error(pipeline_copy: Pipeline, tmp_path: Path) -> None:
    pipeline_copy.set_params(**{"train.device": "cuda"})
    failed = pipeline_copy.python("-m", "stages.train", "--data", "data/prepared/cora", "--out", str(tmp_path / "o"),
                                  check=False)
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines() == [failed.stderr.strip()] and "`train.device`" in failed.stderr
    assert not (tmp_path / "o").exists()


def test_missing_upstream_output_names_the_stage_to_run(pipeline: Pipeline, tmp_path: Path) -> None:
    failed = pipeline.python("-m", "stages.train", "--data", "data/prepared/nowhere", "--out", str(tmp_path),
                             check=False)
    assert failed.returncode == 2
    assert "dvc repro preprocess@cora" in failed.stderr


def test_interrupted_training_is_marked_failed_and_writes_nothing(pipeline_copy: Pipeline, tmp_path: Path) -> None:
    pipeline_copy.set_params(**{"train.optim.max_epochs": 100000, "train.optim.patience": 100000})
    process = subprocess.Popen([str(VENV_BIN / "python"), "-m", "stages.train", "--data", "data/prepared/cora",
                                "--out", str(tmp_path / "out")], cwd=pipeline_copy.root, env=pipeline_copy.env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any(run.info.status == "RUNNING" for run in pipeline_copy.runs(TRAIN_EXPERIMENT)):
            assert process.poll() is None and time.monotonic() < deadline, "training never started a run"
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) != 0
    finally:
        process.kill()
        process.wait()
    statuses = [run.info.status for run in pipeline_copy.runs(TRAIN_EXPERIMENT)]
    assert statuses[-1] == "FAILED" and "RUNNING" not in statuses
    assert not (tmp_path / "out").exists()
