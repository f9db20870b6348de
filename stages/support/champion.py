"""The registered model's champion alias: promoted on val_acc, settled when stages race, verified when loaded."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping

# The machines here have no internet, and a pipeline should not phone home: no usage telemetry.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402  (after the telemetry switch, which MLflow reads when it starts)
from mlflow.entities.model_registry.model_version_status import ModelVersionStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from stages.support.params import fail
from stages.support.store import TRAIN_EXPERIMENT, is_server, refuse_a_foreign_name, store_lock, tracking_uri
from stages.support.tracking import data_digest

# Separate experiments keep the training table one row per training configuration.


CHAMPION = "champion"
# A registered version's tag: SHA-256 over its model's files as the pipeline registered them (model_digest).
MODEL_DIGEST_TAG = "artifacts_sha256"
# A registered version's tag: the logged model's format. Only versions in today's format compete for `champion`:
# an older pipeline registered pickled pytorch models (no `model_format` tag), which check no input when served, and
# a champion left from then would otherwise keep the alias against every equal newcomer. Change the value whenever
# the logged model's format changes (stages/support/served_model.py, train's log_model).
MODEL_FORMAT_TAG = "model_format"
MODEL_FORMAT = "pyfunc from code (served_model.py), tensors as artifacts"


def folder_digest(folder: Path) -> str:
    """data_digest over every file under `folder` by its relative path: what
    `cd folder && find . -type f ! -path ./registered_model_meta -printf '%P\\n' | LC_ALL=C sort |
    xargs -d '\\n' sha256sum | sha256sum` prints."""
    checksums = {}
    for path in sorted(folder.rglob("*")):
        # `registered_model_meta` is written by MLflow's download itself (the version's name and number).
        if path.is_file() and path.relative_to(folder).as_posix() != "registered_model_meta":
            checksums[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return data_digest(checksums)


def model_digest(model_uri: str) -> str:
    """folder_digest of a logged model's files, downloaded from the store."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return folder_digest(Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=folder)))


def version_of(uri: str):
    """The registered version behind `models:/<name>@<alias>` or `models:/<name>/<version>` (MlflowException when
    the model, alias or version does not exist)."""
    name, _, ref = uri.removeprefix("models:/").partition("@")
    client = MlflowClient()
    if ref:
        return client.get_model_version_by_alias(name, ref)
    name, _, number = name.partition("/")
    return client.get_model_version(name, number)


def download_verified_model(uri: str, folder: Path):
    """Download `models:/<name>@<alias>` or `models:/<name>/<version>` into `folder` and check that its files are
    those the pipeline registered (the version's artifacts_sha256 tag); else one line, before any of its code runs.
    Returns the version and the model's local folder: load or serve those very files."""
    version = version_of(uri)
    if version.tags.get(MODEL_FORMAT_TAG) != MODEL_FORMAT:
        fail(f"{uri} is {version.name} version {version.version}, which an older pipeline registered (a pickled "
             "pytorch model, which checks no input): not loaded; `make repro` registers today's model, or name a "
             "newer version")
    expected = version.tags.get(MODEL_DIGEST_TAG)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{version.name}/{version.version}", dst_path=str(folder)))
    found = folder_digest(local)
    if expected is None or found != expected:
        fail(f"{uri} (version {version.version}) is not the model the pipeline registered: its files' SHA-256 "
             f"is {found}, the version's {MODEL_DIGEST_TAG} tag says {expected}; it was not loaded (its code "
             "never ran): tell the server's admin, and use another version")
    return version, local


def load_verified_model(uri: str):
    """The pyfunc model (stages/support/served_model.py) at `uri`, loaded only if download_verified_model
    verified its files; the files checked are the files loaded."""
    import tempfile

    import mlflow.pyfunc

    with tempfile.TemporaryDirectory() as folder:
        return mlflow.pyfunc.load_model(str(download_verified_model(uri, Path(folder))[1]))


def refuse_a_foreign_champion(client: MlflowClient, model: str, current) -> None:
    """Stop, in one line, when the champion was not made by this pipeline: its run is not in the training
    experiment (another user created the registered model first, and owns it and its alias)."""
    try:
        experiment = client.get_experiment(client.get_run(current.run_id).info.experiment_id).name
    except MlflowException:
        experiment = "(a run this user cannot read)"
    if experiment != TRAIN_EXPERIMENT:
        fail(f"registered model {model}'s @{CHAMPION} (version {current.version}) was not made by this pipeline "
             f"(its run is in experiment {experiment}, not {TRAIN_EXPERIMENT}): another user owns the name; the "
             "server's admin deletes it, then runs `make team-up`, which makes every pipeline name as the admin")


def promote_if_champion(run_id: str, model: str, model_uri: str, val_acc: float) -> str:
    """Register the run's model (`model_uri`, as log_model returned it) as a version of `model` if its val_acc is
    strictly higher than the current champion's (or there is none), and point the `champion` alias at the best
    version (settle_champion). Returns a sentence saying what happened.

    Validation accuracy, not test accuracy, picks the champion: choosing on the test split would leak it.
    """
    client = MlflowClient()
    with store_lock():  # SQLite: one evaluation at a time; a server has no lock, settle_champion makes it right
        current = _champion(client, model)
        if is_server(tracking_uri()) and current is None:
            try:
                client.get_registered_model(model)
                refuse_a_foreign_name("registered model", model, model)
            except MlflowException:
                pass  # not registered yet: made below, by this user
        if current is not None:
            refuse_a_foreign_name("registered model", model, model)
            refuse_a_foreign_champion(client, model, current)
            best = float(current.tags.get("val_acc", "nan"))
            # An older pipeline's champion (another format) is not compared: today's model takes the alias.
            if current.tags.get(MODEL_FORMAT_TAG) == MODEL_FORMAT and (current.run_id == run_id or not val_acc > best):
                return (f"champion stays {model} version {current.version} (val_acc {best:.4f}; "
                        f"this run {val_acc:.4f})")
        else:
            try:
                client.create_registered_model(model, description=model_description(model))
            except MlflowException:
                pass  # registered already, with no champion yet
        version = _new_version(client, model, model_uri, {"val_acc": repr(val_acc), MODEL_FORMAT_TAG: MODEL_FORMAT,
                                                          MODEL_DIGEST_TAG: model_digest(model_uri)})
        champion = settle_champion(client, model)
    if champion.version == version.version:
        return f"registered as {model} version {version.version}, now `{CHAMPION}` (val_acc {val_acc:.4f})"
    return (f"registered as {model} version {version.version} (val_acc {val_acc:.4f}); `{CHAMPION}` is version "
            f"{champion.version} (val_acc {float(champion.tags['val_acc']):.4f}), registered at the same time")


def model_description(model: str) -> str:
    """The registered model's description (Markdown in MLflow's UI)."""
    return (f"GAT models trained by the pipeline on {model.removeprefix('gat-')}. The `{CHAMPION}` alias marks the "
            "version with the highest validation accuracy.")


def _new_version(client: MlflowClient, model: str, model_uri: str, tags: dict[str, str]):
    """A new version of the registered model `model` (created above) from the logged model `model_uri`
    (`models:/<model_id>`), as mlflow.register_model makes it, without its side effects on a clean run's output:
    it creates the registered model again ("Registered model 'gat-cora' already exists", on a brand-new store too),
    prints "Created version ...", and logs "Waiting up to 300 seconds ..." against a server. That wait is for a
    version PENDING_REGISTRATION, which MLflow's own stores never make (SQLite, and a server's SQLAlchemy store,
    create a version READY); a registry that copies files first (Databricks) would, and the alias must not point
    at a version that may yet fail, so such a version is an error here instead of a wait."""
    model_id = model_uri.removeprefix("models:/")
    # The store finds the run from the logged model, as register_model leaves it to.
    version = client.create_model_version(model, model_uri, tags=tags, await_creation_for=0, model_id=model_id)
    if version.status != ModelVersionStatus.to_string(ModelVersionStatus.READY):
        fail(f"{model} version {version.version} was created {version.status}, not READY: this registry prepares "
             "versions after creating them, which the pipeline does not support; track into mlflow.db or an MLflow "
             "server (see the README's team mode)")
    # What register_model does next: the logged model's page lists its registered versions from this tag.
    linked = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        [*linked, {"name": model, "version": version.version}])})
    return version


def _champion(client: MlflowClient, model: str):
    """The version the `champion` alias points at, or None."""
    try:
        return client.get_model_version_by_alias(model, CHAMPION)
    except MlflowException:
        return None


# How often settle_champion reads, fixes and reads again before it gives up: each round that does not settle
# means another evaluation registered a version meanwhile.
SETTLE_ROUNDS = 20


def _pipeline_versions(client: MlflowClient, model: str) -> dict[str, float]:
    """Version number -> val_acc of every version the pipeline registered in today's format (with its val_acc and
    artifacts_sha256 tags, and MODEL_FORMAT)."""
    versions = client.search_model_versions(f"name = '{model}'")
    return {v.version: float(v.tags["val_acc"]) for v in versions
            if {"val_acc", MODEL_DIGEST_TAG} <= set(v.tags) and v.tags.get(MODEL_FORMAT_TAG) == MODEL_FORMAT}


def _best(versions: Mapping[str, float]) -> str:
    """The version with the highest val_acc; of equals the oldest, so that an equal newcomer never displaces it."""
    return max(versions, key=lambda number: (versions[number], -int(number)))


# How a server's store answers an insert that lost the race (MLflow's managed database session: SQLAlchemy's errors
# as BAD_REQUEST, others as INTERNAL_ERROR).
_LOST_RACE_CODES = frozenset({"BAD_REQUEST", "INTERNAL_ERROR"})


def _set_champion(client: MlflowClient, model: str, version: str) -> None:
    """Point `champion` at `version`. A server's store sets an alias by reading whether it exists and then inserting
    or updating it, so two evaluations that both found no alias both insert, and the second fails on the table's
    unique key. The store answers that as a bad request (its database's error) or an internal error, and it means
    another evaluation set the alias meanwhile: settle_champion's next round reads it and sets it again if it is not
    the best. Any other failure is raised: a refusal (permission, authentication), or a failure with the alias still
    missing."""
    try:
        client.set_registered_model_alias(model, CHAMPION, version)
    except MlflowException as error:
        if error.error_code not in _LOST_RACE_CODES or _champion(client, model) is None:
            raise


def settle_champion(client: MlflowClient, model: str):
    """Point `champion` at the best registered version, safely against evaluations registering at the same time.

    A server has no lock around read-then-set: two evaluations that both saw no champion both set the alias, and
    the last one won, worse or not. So every evaluation that registered a version reads all versions, sets the
    alias to the best, and reads again, until nothing changed: whoever sets the alias last then has read every
    version registered before it, so the alias ends on the true best. Returns that version.
    """
    versions = _pipeline_versions(client, model)
    for _ in range(SETTLE_ROUNDS):
        best = _best(versions)
        current = _champion(client, model)
        if current is None or current.version != best:
            _set_champion(client, model, best)
        seen, versions = versions, _pipeline_versions(client, model)
        current = _champion(client, model)
        if versions == seen and current is not None and current.version == best:
            return current
    fail(f"the `{CHAMPION}` alias of {model} kept changing for {SETTLE_ROUNDS} rounds (evaluations registering "
         "versions at the same time): rerun evaluate, which settles it")
