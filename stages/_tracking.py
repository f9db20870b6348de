"""MLflow for the stage scripts: where the store is, how runs are tagged, and that none is left RUNNING."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator, Mapping

# The machines here have no internet, and a pipeline should not phone home: no usage telemetry.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402  (after the telemetry switch, which MLflow reads when it starts)
from filelock import FileLock
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from stages._common import fail, repo_root

# Separate experiments keep the training table one row per training configuration.
TRAIN_EXPERIMENT = "gat-repro"
DATA_EXPERIMENT = "gat-repro-data"
REPRODUCE_EXPERIMENT = "gat-repro-reproduce"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set (a team server), else a SQLite file at the repo root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def _sqlite_folder(uri: str) -> Path | None:
    """The folder of a SQLite store's database file (`sqlite:///rel` or `sqlite:////abs`), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).resolve().parent


def artifact_root() -> Path:
    # Next to the database, so a store elsewhere (tests: a tmp SQLite file) keeps its artifacts out of the repo.
    return (_sqlite_folder(tracking_uri()) or repo_root()) / "mlartifacts"


def connect(experiment: str) -> str:
    """Point MLflow at the store and return the experiment id, creating both once.

    A brand-new SQLite store migrated by two processes at once fails, so the first
    touch (schema creation, experiment creation) happens under a file lock.
    """
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    store = _sqlite_folder(uri)
    lock = FileLock(str(store / ".mlflow.lock")) if store else contextlib.nullcontext()
    with lock:
        client = MlflowClient()
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        location = (artifact_root() / experiment).as_uri() if store else None
        return client.create_experiment(experiment, artifact_location=location)


def data_digest(checksums: Mapping[str, str]) -> str:
    """One SHA-256 over the per-file checksums, in the `sha256sum` line format, sorted by file."""
    lines = "".join(f"{checksums[name]}  {name}\n" for name in sorted(checksums))
    return hashlib.sha256(lines.encode()).hexdigest()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def standard_tags(dataset: str, checksums: Mapping[str, str]) -> dict[str, str]:
    """Tags every training-related run carries, so runs can be traced to code, experiment and data."""
    commit = git_commit()
    tags = {
        "git_commit": commit,
        "mlflow.source.git.commit": commit,
        "dataset": dataset,
        "data_sha256": data_digest(checksums),
        "dvc_stage": os.environ.get("DVC_STAGE", "(run by hand)"),
    }
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc_exp_name"] = os.environ["DVC_EXP_NAME"]
    return tags


@contextlib.contextmanager
def stage_run(experiment: str | None = None, run_name: str | None = None, tags: Mapping[str, str] | None = None,
              run_id: str | None = None, nested: bool = False) -> Iterator[mlflow.ActiveRun]:
    """Start (or, with `run_id`, resume) a run that ends FINISHED, or FAILED on any exception.

    The stage scripts turn SIGTERM into SystemExit (stages._common.main), so an
    interrupted `dvc repro` marks the run FAILED too instead of leaving it RUNNING.
    """
    if run_id is None:
        experiment_id = connect(experiment)
    else:
        mlflow.set_tracking_uri(tracking_uri())
        experiment_id = None
        try:
            MlflowClient().get_run(run_id)
        except MlflowException:
            fail(f"MLflow run {run_id} is not in the tracking store {tracking_uri()}: the stage that made it "
                 "logged to another store. Rerun that stage against this one (`dvc repro --force <stage>`).")
    with mlflow.start_run(run_id=run_id, experiment_id=experiment_id,
                          run_name=run_name, tags=dict(tags or {}), nested=nested) as run:
        yield run


def log_dataset(dataset: str, source: str, checksums: Mapping[str, str], context: str) -> None:
    """Record the raw files as an MLflow dataset input: their source and a digest of their bytes."""
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    meta = MetaDataset(HTTPDatasetSource(source), name=dataset, digest=data_digest(checksums)[:16])
    mlflow.log_input(meta, context=context)


class EpochLogger:
    """Per-epoch step metrics, sent in batches: one SQLite transaction per epoch would cost seconds per run."""

    def __init__(self, run_id: str, every: int = 100):
        self.run_id, self.every, self.pending = run_id, every, []
        self.client = MlflowClient()

    def log(self, row: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        self.pending += [Metric(key, float(value), timestamp, int(row["epoch"]))
                         for key, value in row.items() if key != "epoch"]
        if len(self.pending) >= self.every * len(row):
            self.flush()

    def flush(self) -> None:
        while self.pending:  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=self.pending[:1000])
            self.pending = self.pending[1000:]

    def __enter__(self) -> "EpochLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.flush()


def log_child_runs(parent_run_id: str, experiment_id: str, rows: list[Mapping[str, float]],
                   tags: Mapping[str, str]) -> None:
    """One finished child run per seed under the parent, with that seed's final metrics.

    Written with the client directly: four calls per seed keep 100 children to seconds.
    """
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient()
    timestamp = int(time.time() * 1000)
    for row in rows:
        child = client.create_run(experiment_id, run_name=f"seed-{row['seed']}",
                                  tags={**tags, "mlflow.parentRunId": parent_run_id})
        client.log_batch(child.info.run_id, params=[Param("seed", str(row["seed"]))],
                         metrics=[Metric(k, float(v), timestamp, 0) for k, v in row.items() if k != "seed"],
                         tags=[RunTag("seed", str(row["seed"]))])
        client.set_terminated(child.info.run_id, "FINISHED")
