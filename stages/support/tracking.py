"""MLflow runs for the stages: how runs are tagged, started and ended (never left RUNNING), and what they log."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import time
from typing import Any, Iterator, Mapping, Sequence

# The machines here have no internet, and a pipeline should not phone home: no usage telemetry.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402  (after the telemetry switch, which MLflow reads when it starts)
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gat.config import Params, flatten
from stages.support.redaction import redact
from stages.support.params import fail, parse_params_yaml
from stages.support.store import (CLEANUP_TIMEOUT_S, SERVER_ERRORS, connect, from_server, is_server, process_tags,
                                  shown_uri,
                                  store_full, store_problem, tracking_uri, use_store)

# Separate experiments keep the training table one row per training configuration.


def data_digest(checksums: Mapping[str, str]) -> str:
    """One SHA-256 over the per-file checksums, in the `sha256sum` line format, sorted by file."""
    lines = "".join(f"{checksums[name]}  {name}\n" for name in sorted(checksums))
    return hashlib.sha256(lines.encode()).hexdigest()


def git_commit(folder: str | os.PathLike | None = None) -> str:
    """The commit checked out in `folder` (default: the working directory), or "unknown"."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=folder).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def standard_tags(dataset: str, checksums: Mapping[str, str], split_seed: int | None = None) -> dict[str, str]:
    """Tags every training-related run carries, so runs can be traced to code, experiment and data; `split_seed`:
    an npz graph's (params.yaml's `graphs.<name>.split_seed`, in meta.json's split), which picks its nodes."""
    commit = git_commit()
    tags = {
        "git_commit": commit,
        "mlflow.source.git.commit": commit,
        "dataset": dataset,
        "data_sha256": data_digest(checksums),
        "dvc_stage": os.environ.get("DVC_STAGE", "(run by hand)"),
    }
    if split_seed is not None:
        tags["split_seed"] = str(split_seed)
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc_exp_name"] = os.environ["DVC_EXP_NAME"]
    return tags


def split_seed(meta: Mapping[str, Any]) -> int | None:
    """The split seed of an npz graph's prepared meta.json (the Pitfalls split's), None for a Planetoid dataset."""
    split = meta.get("split")
    return split.get("seed") if isinstance(split, dict) and split.get("name") == "pitfalls" else None


@contextlib.contextmanager
def stage_run(experiment: str | None = None, run_name: str | None = None, tags: Mapping[str, str] | None = None,
              run_id: str | None = None, nested: bool = False) -> Iterator[mlflow.ActiveRun]:
    """Start (or, with `run_id`, resume) a run that ends FINISHED, or FAILED on any exception.

    The stage scripts turn SIGTERM into SystemExit (stages.support.interrupts.main), so an
    interrupted `dvc repro` marks the run FAILED too instead of leaving it RUNNING.
    """
    from mlflow.entities import RunTag

    if run_id is None:
        if experiment is None:
            raise ValueError("stage_run needs an experiment or a run_id")
        try:
            experiment_id: str | None = connect(experiment)
        except SERVER_ERRORS as error:
            if store_full(error) is None:
                raise
            fail(store_problem(error, experiment))
    else:
        use_store()
        experiment_id = None
        try:
            MlflowClient().get_run(run_id)
        except MlflowException:
            fail(f"MLflow run {run_id} is not in the tracking store {shown_uri()}: the stage that made it "
                 "logged to another store. Rerun that stage against this one (`dvc repro --force <stage>`).")
    what = experiment or run_id or "?"
    try:
        if run_id is not None:  # this process owns the resumed run before it is RUNNING again, never after
            MlflowClient().log_batch(run_id, tags=[RunTag(key, value) for key, value in process_tags().items()])
        run = mlflow.start_run(run_id=run_id, experiment_id=experiment_id, run_name=run_name,
                               tags={**(tags or {}), **process_tags()}, nested=nested)
    except SERVER_ERRORS as error:
        fail(store_problem(error, what))
    try:
        yield run
    except BaseException as error:
        ended = _end_failed(run.info.run_id, error)
        # A full disk, or the server's failure; anything else is a bug: its traceback shows.
        if store_full(error) is not None or (is_server(tracking_uri()) and from_server(error)):
            fail(store_problem(error, what, ended))
        raise
    try:
        mlflow.end_run("FINISHED")
    except SERVER_ERRORS as error:
        fail(store_problem(error, what, _end_failed(run.info.run_id, error)))


def _end_failed(run_id: str, error: BaseException) -> bool:
    """Mark the run FAILED and say whether that worked; when the store itself is what failed, there is nothing more
    to do. After a failure of the server, one short try (CLEANUP_TIMEOUT_S, no retry): the stage must not wait
    for a frozen server a second time."""
    quick = is_server(tracking_uri()) and from_server(error)
    with _quick_requests() if quick else contextlib.nullcontext():
        try:
            active = mlflow.active_run()
            if active is not None and active.info.run_id == run_id:
                mlflow.end_run("FAILED")
            else:  # a child run, or end_run("FINISHED") failed after taking the run off MLflow's stack
                MlflowClient().set_terminated(run_id, "FAILED")
        except SERVER_ERRORS:
            return False
    return True


@contextlib.contextmanager
def _quick_requests() -> Iterator[None]:
    """MLflow's requests inside: one try of CLEANUP_TIMEOUT_S (MLflow reads these settings at every request)."""
    quick = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(CLEANUP_TIMEOUT_S), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    saved = {key: os.environ.get(key) for key in quick}
    os.environ.update(quick)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def log_dataset(dataset: str, source: str, checksums: Mapping[str, str], context: str) -> None:
    """Record the raw files as an MLflow dataset input: their source and a digest of their bytes."""
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    meta = MetaDataset(HTTPDatasetSource(source), name=dataset,  # type: ignore[abstract]  # MLflow's own helper
                       digest=data_digest(checksums)[:16])
    mlflow.log_input(meta, context=context)


class EpochLogger:
    """Per-epoch step metrics, sent in batches: one SQLite transaction per epoch would cost seconds per run."""

    def __init__(self, run_id: str, every: int = 100):
        self.run_id, self.every = run_id, every
        self.pending: list = []
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

    def __exit__(self, kind, error, traceback) -> None:
        if not from_server(error):  # the batch the server failed on would wait for it a second time
            self.flush()


def log_child_runs(parent_run_id: str, experiment_id: str, dataset: str,
                   rows: Sequence[Mapping[str, float | int | str]], timings: Mapping[int, tuple[float, float]],
                   tags: Mapping[str, str], seed_tags: Mapping[int, Mapping[str, str]] | None = None) -> None:
    """One finished child run per seed under the parent, with that seed's final metrics.

    A row's numbers are metrics and its text (the weights' SHA-256) tags. `timings` maps a seed to the
    wall-clock (start, end) of its training, in seconds since the epoch, so the UI shows each seed's real
    duration. `seed_tags` adds tags per seed: where it ran (the worker's host, torch and CPU facts). Written
    with the client directly: a few calls per seed keep 100 children to seconds. A child whose logging fails or is
    stopped (SIGTERM, Ctrl-C) ends FAILED, as its parent will, not RUNNING.
    """
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient()
    for row in rows:
        seed = int(row["seed"])
        start_ms, end_ms = (int(1000 * t) for t in timings[seed])
        child = client.create_run(experiment_id, start_time=start_ms, run_name=f"{dataset}-seed-{seed}",
                                  tags={**tags, **process_tags(), "mlflow.parentRunId": parent_run_id})
        texts = {k: v for k, v in row.items() if isinstance(v, str)}
        try:
            client.log_batch(child.info.run_id, params=[Param("seed", str(seed))],
                             metrics=[Metric(k, float(v), end_ms, 0) for k, v in row.items()
                                      if k != "seed" and not isinstance(v, str)],
                             tags=[RunTag(k, str(v)) for k, v in
                                   {"seed": str(seed), **texts, **(seed_tags or {}).get(seed, {})}.items()])
            client.set_terminated(child.info.run_id, "FINISHED", end_time=end_ms)
        except BaseException as error:
            _end_failed(child.info.run_id, error)
            raise


# The params.yaml keys (dotted prefixes) each stage logs into its MLflow run: its own, as dvc.yaml's `params` lists
# them, and for train those of the stages whose outputs it reads too, so a training row names the data it came
# from. `{dataset}` is a foreach stage's dataset. reproduce also logs how it ran (batches, workers, executor,
# device), which dvc.yaml leaves out because the results do not depend on it. evaluate and analyze log into
# train's run and log no params: a rerun with other analyze params could not change a logged one.
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "download": ("download", "graphs.{dataset}"),
    "preprocess": ("preprocess", "graphs.{dataset}"),
    "train": ("datasets", "download", "preprocess", "train", "graphs.{dataset}"),
    "reproduce": ("reproduce.seeds", "reproduce.first_seed", "reproduce.seeds_per_batch", "reproduce.workers",
                  "reproduce.executor", "reproduce.device", "reproduce.protocol.{dataset}", "graphs.{dataset}"),
    # Not a DVC stage: python -m stages.ablation, which runs reproduce's protocols and executor.
    "ablation": ("ablation", "reproduce.seeds_per_batch", "reproduce.workers", "reproduce.executor",
                 "reproduce.device", "reproduce.protocol"),
}


def _flat(params: Params) -> dict[str, Any]:
    """Every param with params.yaml's dotted key (`train.optim.lr`), a URL's password redacted."""
    flat = flatten(params)
    flat["download.base_url"] = redact(flat["download.base_url"])
    return flat


def logged_params(params: Params, stage: str, dataset: str | None = None) -> dict[str, Any]:
    """The params `stage` logs (STAGE_PARAMS), with params.yaml's dotted keys, so runs compare column by column;
    `dataset`: a foreach stage's own (download, preprocess, reproduce)."""
    prefixes = [prefix.format(dataset=dataset) for prefix in STAGE_PARAMS[stage]]
    return {key: value for key, value in _flat(params).items()
            if any(key == prefix or key.startswith(f"{prefix}.") for prefix in prefixes)}


def params_changed_from_committed(current: Mapping[str, object], committed_yaml: str | None) -> dict[str, tuple]:
    """Dotted key -> (committed value, this run's value) for every param in `current` that differs from the
    committed params.yaml, both read as typed params (so `30` and `30.0` are the same value).

    `committed_yaml` is the text of params.yaml at git HEAD (None when there is none); a committed file
    that does not validate any more (an older layout) leaves nothing to compare with.
    """
    import yaml

    from gat.config import ParamsError

    if committed_yaml is None:
        return {}
    try:
        committed = _flat(Params.from_dict(parse_params_yaml(committed_yaml)))
    except (yaml.YAMLError, ParamsError):
        return {}
    return {key: (committed.get(key, "(not set)"), value) for key, value in current.items()
            if committed.get(key) != value}


def committed_params_yaml() -> str | None:
    """params.yaml as committed at HEAD, the defaults a run is described against; None outside a git checkout."""
    try:
        return subprocess.run(["git", "show", "HEAD:params.yaml"], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def code_span(value: object) -> str:
    """`value` as a Markdown code span: MLflow's UI renders descriptions as Markdown, where a bare `<name>` is an
    HTML tag (dropped) and `_` or `*` may turn text italic. The fence is one backtick longer than any in it."""
    text = str(value)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def describe_run(what: str, current: Mapping[str, object]) -> str:
    """A run's description for the UI: what it holds, then the params that differ from the committed defaults."""
    changed = params_changed_from_committed(current, committed_params_yaml())
    if not changed:
        return f"{what}\n\nAll params as committed in params.yaml (the defaults)."
    lines = "\n".join(f"- {code_span(key)}: {code_span(this)} (committed: {code_span(before)})"
                      for key, (before, this) in sorted(changed.items()))
    return f"{what}\n\nParams that differ from the committed params.yaml:\n{lines}"


