"""A full disk under each place the train stage writes: one line, exit 2, no temporary file, no RUNNING run.

Each case runs the real stage in a mount namespace of its own (`unshare --mount`), with a small tmpfs over
the folder that fills: the mount vanishes with the stage, and nothing outside it is touched. What the full
folder holds when the stage has exited is listed from inside the namespace, as a last command.

- the output folder (data/train): the temporary model file is removed, no output is written, the run FAILED;
- the MLflow store's artifact folder (mlartifacts): the run FAILED, no output;
- the MLflow store's database folder, filled while the stage trains: the run ends FAILED where SQLite can
  still rewrite its row, else the next stage that opens the experiment ends it KILLED (its process is gone).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from pipeline_support import VENV_BIN, Pipeline

from stages.support.store import TRAIN_EXPERIMENT

# Long enough training that the database fills while it runs; the stage is stopped by the full disk.
ENDLESS = {"train.optim.max_epochs": 100000, "train.optim.patience": 100000}
# The listing's marker in stdout, after which come the names left in the full folder.
LISTING = "--- left in the full folder:"
STAGE_S = 300


def _unshare() -> list[str]:
    """The command prefix for a private mount namespace: as root directly, else in a user namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare")
    prefix = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        prefix.insert(1, "--map-root-user")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here ({probe.stderr.strip()})")
    return prefix


def _train_on_full(pipeline: Pipeline, full: Path, size: str, before: str = "", during: str = "", after: str = "",
                   env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the train stage with a tmpfs of `size` mounted over `full`; `before` runs once it is mounted, `during`
    while the stage runs (it is started in the background), `after` once it has exited. Returns the stage's
    result and what `full` then holds."""
    full.mkdir(parents=True, exist_ok=True)
    train = shlex.join([str(VENV_BIN / "python"), "-m", "stages.train", "--data", "data/prepared/cora",
                        "--out", "data/train"])
    script = "\n".join([
        f"mount -t tmpfs -o size={size},mode=755 tmpfs {shlex.quote(str(full))} || exit 99",
        before,
        f"{train} & stage=$!",
        during,
        "wait $stage; code=$?",
        after,
        f"echo {shlex.quote(LISTING)}; ls -A {shlex.quote(str(full))}",
        "exit $code"])
    done = subprocess.run([*_unshare(), "sh", "-c", script], cwd=pipeline.root, env=env or pipeline.env,
                          capture_output=True, text=True, timeout=STAGE_S)
    assert done.returncode != 99, done.stderr
    stdout, _, listing = done.stdout.partition(LISTING)
    return subprocess.CompletedProcess(done.args, done.returncode, stdout, done.stderr), listing.split()


def _one_line(done: subprocess.CompletedProcess, expected: str) -> None:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert len(errors) == 1 and expected in errors[0], done.stderr[-4000:]


def _new_runs(pipeline: Pipeline, before: set[str]) -> list:
    return [run for run in pipeline.runs(TRAIN_EXPERIMENT) if run.info.run_id not in before]


def test_a_full_output_folder(pipeline_copy: Pipeline) -> None:
    before = {run.info.run_id for run in pipeline_copy.runs(TRAIN_EXPERIMENT)}
    shutil.rmtree(pipeline_copy.root / "data/train")  # as dvc does before it runs the stage
    done, left = _train_on_full(pipeline_copy, pipeline_copy.root / "data/train", "16k")
    _one_line(done, "no space left on the device that holds data/train: free some space there (`df -h data/train`)")
    assert left == []  # neither an output nor `.model.pt.*`
    [run] = _new_runs(pipeline_copy, before)
    assert run.info.status == "FAILED"


def test_a_full_artifact_folder(pipeline_copy: Pipeline, tmp_path: Path) -> None:
    """A store of its own, so that its artifact folder (mlartifacts, beside the database) is the full one."""
    store = tmp_path / "store"
    env = {**pipeline_copy.env, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    subprocess.run([str(VENV_BIN / "python"), "-m", "tools.init_store"], cwd=pipeline_copy.root, env=env,
                   check=True, capture_output=True)
    shutil.rmtree(pipeline_copy.root / "data/train")
    done, _ = _train_on_full(pipeline_copy, store / "mlartifacts", "8k", env=env)
    _one_line(done, f"no space left on the device that holds {store / 'mlartifacts'}")
    assert not (pipeline_copy.root / "data/train").exists()
    store_pipeline = Pipeline(pipeline_copy.root, env)
    [run] = store_pipeline.runs(TRAIN_EXPERIMENT)
    assert run.info.status == "FAILED"


def test_a_full_database_folder(pipeline_copy: Pipeline, tmp_path: Path) -> None:
    """The store's own folder fills while the stage trains: SQLite refuses the next metrics. One line, exit 2, and
    no run left RUNNING for good."""
    store = tmp_path / "store"
    env = {**pipeline_copy.env, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    pipeline_copy.set_params(**ENDLESS)
    shutil.rmtree(pipeline_copy.root / "data/train")
    python = shlex.quote(str(VENV_BIN / "python"))
    running = (f"{python} -c \"import sqlite3, sys; sys.exit(sqlite3.connect(sys.argv[1]).execute("
               f"\\\"SELECT count(*) FROM runs WHERE status = 'RUNNING'\\\").fetchone()[0] == 0)\" "
               f"{shlex.quote(str(store / 'mlflow.db'))}")
    done, left = _train_on_full(
        pipeline_copy, store, "16M",
        before=f"{python} -m tools.init_store > /dev/null || exit 98",
        # Once the run is RUNNING (bounded: 120 s), a few epochs later, the rest of the tmpfs is filled.
        during=(f"for i in $(seq 600); do {running} 2> /dev/null && break; sleep 0.2; done; sleep 2; "
                f"dd if=/dev/zero of={shlex.quote(str(store / 'filler'))} bs=64k 2> /dev/null"),
        after=f"cp -p {shlex.quote(str(store / 'mlflow.db'))} {shlex.quote(str(tmp_path / 'mlflow.db'))}",
        env=env)
    _one_line(done, f"no space left on the device that holds {store}")
    assert not (pipeline_copy.root / "data/train").exists()
    # The tmpfs is gone with the namespace; its database, copied once the stage had exited, takes its place.
    store.mkdir(exist_ok=True)
    shutil.copy2(tmp_path / "mlflow.db", store / "mlflow.db")
    assert "mlflow.db" in left and "filler" in left
    store_pipeline = Pipeline(pipeline_copy.root, env)
    [run] = store_pipeline.runs(TRAIN_EXPERIMENT)
    # Marking the run FAILED rewrites its row in place, which SQLite can often do on a full disk; when it can't,
    # the run stays RUNNING, and the next stage that opens the experiment ends it KILLED.
    assert run.info.status in {"FAILED", "RUNNING"}
    opened = subprocess.run([str(VENV_BIN / "python"), "-c",
                             "from stages.support.store import connect, TRAIN_EXPERIMENT; connect(TRAIN_EXPERIMENT)"],
                            cwd=pipeline_copy.root, env=env, capture_output=True,
                            text=True, timeout=STAGE_S)
    assert opened.returncode == 0, opened.stderr
    assert ("as KILLED" in opened.stderr) == (run.info.status == "RUNNING"), opened.stderr
    assert store_pipeline.client.get_run(run.info.run_id).info.status == (
        "KILLED" if run.info.status == "RUNNING" else "FAILED")
