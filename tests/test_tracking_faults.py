"""Tracking faults end in one line and leave no run RUNNING (issue 17): a frozen tracking server, runs left
RUNNING by killed stages, and evaluations racing for `@champion`.

The stages here are stand-ins: small scripts that open a run the way every stage does (stages.support.tracking.stage_run
under stages.support.interrupts.main) and then wait for a file, in a SQLite store of their own or against the real team
server (tests/team_support.py). Every wait is a poll with a deadline; every process a test starts, or stops with
SIGSTOP, is killed or continued in a `finally`, by its pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import BAD_REQUEST, PERMISSION_DENIED
from mlflow.tracking import MlflowClient
from pipeline_support import REPO, VENV_BIN, Pipeline, clean_env
from team_support import TeamBackend

from stages.support.champion import CHAMPION, MODEL_FORMAT, MODEL_FORMAT_TAG
from stages.support.store import HOST_TAG, PID_START_TAG, PID_TAG, TRAIN_EXPERIMENT

# A stage that opens a run in the training experiment, writes the run's id to argv[2], waits (at most 10
# minutes) for the file argv[1], then logs a metric: the request that meets a frozen server.
STAND_IN_STAGE = '''
import sys, time
from pathlib import Path
import mlflow
from stages.support.interrupts import main
from stages.support.store import TRAIN_EXPERIMENT
from stages.support.tracking import stage_run

def run():
    go, started = Path(sys.argv[1]), Path(sys.argv[2])
    with stage_run(TRAIN_EXPERIMENT, "stand-in") as active:
        started.write_text(active.info.run_id)
        for _ in range(6000):
            if go.exists():
                break
            time.sleep(0.1)
        mlflow.log_metric("after_the_wait", 1.0)

if __name__ == "__main__":
    main(run)
'''

# An evaluation's last step: argv = model_uri, run id, val_acc, registered model name, the file to wait for, and
# how long to sleep after it; says it is ready to go in `<go>.ready-<pid>`; prints promote_if_champion's sentence.
EVALUATOR = '''
import os, sys, time
from pathlib import Path
from stages.support.interrupts import main
from stages.support.champion import promote_if_champion
from stages.support.store import use_store

def run():
    model_uri, run_id, val_acc, name, go, delay = sys.argv[1:]
    use_store()
    Path(f"{go}.ready-{os.getpid()}").touch()
    for _ in range(6000):
        if Path(go).exists():
            break
        time.sleep(0.05)
    time.sleep(float(delay))
    print(promote_if_champion(run_id, name, model_uri, float(val_acc)), flush=True)

if __name__ == "__main__":
    main(run)
'''

# How long a stage may take to start (imports, the MLflow store) on a busy 2-core machine.
START_S = 120.0
# The most a stage may take to give up on a frozen server: about 32 s for the failing request (3 tries of 10 s)
# and 3 s for marking the run FAILED; generous for a busy machine.
FROZEN_STOP_S = 90.0


def _poll(condition: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


class Stages:
    """Stand-in stages started in a test, each killed in the end by its pid."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path, self.env = tmp_path, env
        self.script = tmp_path / "stand_in_stage.py"
        self.script.write_text(STAND_IN_STAGE)
        self.started: list[subprocess.Popen] = []

    def start(self, name: str) -> tuple[subprocess.Popen, str]:
        """A stand-in, once its run is RUNNING: the process and the run's id."""
        process = self.launch(name)
        return process, self.wait_for_run(name, process)

    def wait_for_run(self, name: str, process: subprocess.Popen) -> str:
        """The id of the run `process` (started as `name`) opened, once it is RUNNING."""
        started = self.tmp_path / f"{name}.run"
        assert _poll(lambda: started.exists() and started.read_text() or process.poll() is not None, START_S), \
            f"{name} never started its run"
        assert process.poll() is None, self.stderr(name)
        return started.read_text()

    def launch(self, name: str, go_now: bool = False) -> subprocess.Popen:
        if go_now:
            self.go(name)
        with (self.tmp_path / f"{name}.err").open("w") as stderr:
            process = subprocess.Popen([str(VENV_BIN / "python"), str(self.script), str(self.tmp_path / f"{name}.go"),
                                        str(self.tmp_path / f"{name}.run")], cwd=REPO, env=self.env,
                                       stdout=subprocess.DEVNULL, stderr=stderr)
        self.started.append(process)
        return process

    def go(self, name: str) -> None:
        (self.tmp_path / f"{name}.go").touch()

    def run_next(self, name: str) -> tuple[int, list[str]]:
        """A whole stand-in stage, from start to end: its exit code and its stderr lines."""
        code = self.launch(name, go_now=True).wait(timeout=START_S)
        return code, self.stderr(name).strip().splitlines()

    def stderr(self, name: str) -> str:
        return (self.tmp_path / f"{name}.err").read_text()

    def kill_all(self) -> None:
        for process in self.started:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture
def sqlite_stages(tmp_path: Path) -> Iterator[Stages]:
    stages = Stages(tmp_path, clean_env() | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    try:
        yield stages
    finally:
        stages.kill_all()


@pytest.fixture
def server_stages(tmp_path: Path, team_backend: TeamBackend) -> Iterator[Stages]:
    stages = Stages(tmp_path, clean_env() | team_backend.mlflow_env)
    try:
        yield stages
    finally:
        stages.kill_all()


def _note(pids: list[int]) -> str:
    """The line of a stage that ended one run of each of `pids` as KILLED."""
    runs = f"{len(pids)} run{'s' if len(pids) > 1 else ''}"
    return (f"note: ended {runs} of {TRAIN_EXPERIMENT} left RUNNING by stopped stages "
            f"(pids {', '.join(map(str, pids))} on host {socket.gethostname()}) as KILLED")


def _killed(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL


# ------------------------------------------------------------------------------- runs left RUNNING (item 9)

def test_a_killed_stages_run_is_ended_killed_by_the_next_stage(sqlite_stages: Stages) -> None:
    client = MlflowClient(sqlite_stages.env["MLFLOW_TRACKING_URI"])
    process, run_id = sqlite_stages.start("killed")
    tags = client.get_run(run_id).data.tags
    assert (tags[HOST_TAG], tags[PID_TAG]) == (socket.gethostname(), str(process.pid))
    assert tags[PID_START_TAG].isdigit()
    _killed(process)
    assert client.get_run(run_id).info.status == "RUNNING"
    code, lines = sqlite_stages.run_next("next")
    assert code == 0, lines
    assert lines == [_note([process.pid])]
    assert client.get_run(run_id).info.status == "KILLED"
    assert client.get_run((sqlite_stages.tmp_path / "next.run").read_text()).info.status == "FINISHED"


def test_make_ui_ends_abandoned_runs_before_the_ui_shows_them(sqlite_stages: Stages) -> None:
    """`make repro` first runs tools.init_store, which opens every experiment, as `make ui` (tools.ui) does."""
    client = MlflowClient(sqlite_stages.env["MLFLOW_TRACKING_URI"])
    process, run_id = sqlite_stages.start("killed")
    _killed(process)
    done = subprocess.run([str(VENV_BIN / "python"), "-m", "tools.init_store"], cwd=REPO, env=sqlite_stages.env,
                          capture_output=True, text=True, timeout=START_S)
    assert done.returncode == 0, done.stderr
    assert _note([process.pid]) in done.stderr.splitlines()
    assert client.get_run(run_id).info.status == "KILLED"


def test_runs_of_living_stages_other_hosts_and_older_versions_are_left_alone(sqlite_stages: Stages) -> None:
    client = MlflowClient(sqlite_stages.env["MLFLOW_TRACKING_URI"])
    living, living_run = sqlite_stages.start("living")
    experiment_id = client.get_run(living_run).info.experiment_id
    host, start = socket.gethostname(), client.get_run(living_run).data.tags[PID_START_TAG]
    planted = {
        # The living stage's pid, but another process's start time: that pid was reused, the old stage is gone.
        "reused pid": {HOST_TAG: host, PID_TAG: str(living.pid), PID_START_TAG: str(int(start) - 1)},
        "other host": {HOST_TAG: "another-host", PID_TAG: "999999999", PID_START_TAG: "1"},
        "older run": {},
    }
    runs = {what: client.create_run(experiment_id, tags=tags).info.run_id for what, tags in planted.items()}
    code, lines = sqlite_stages.run_next("next")
    assert code == 0, lines
    assert lines == [_note([living.pid])]
    assert client.get_run(runs["reused pid"]).info.status == "KILLED"
    assert client.get_run(runs["other host"]).info.status == "RUNNING"
    assert client.get_run(runs["older run"]).info.status == "RUNNING"
    assert client.get_run(living_run).info.status == "RUNNING"
    sqlite_stages.go("living")  # the living stage was never disturbed: it ends its run as usual
    assert living.wait(timeout=START_S) == 0, sqlite_stages.stderr("living")
    assert client.get_run(living_run).info.status == "FINISHED"


def test_parallel_stages_never_end_each_others_runs(sqlite_stages: Stages) -> None:
    """Four stages at once (four `dvc exp` runs of a queue), each opening the experiment while the others' runs
    are RUNNING; then a reproduce-like parent with its children logged, while it lives."""
    import mlflow

    from stages.support.store import process_tags
    from stages.support.tracking import log_child_runs

    client = MlflowClient(sqlite_stages.env["MLFLOW_TRACKING_URI"])
    names = [f"parallel-{n}" for n in range(4)]
    for name in names:
        sqlite_stages.launch(name)
    runs = [sqlite_stages.wait_for_run(name, process) for process, name in zip(sqlite_stages.started, names)]
    for name in names:
        sqlite_stages.go(name)
    for process, name, run_id in zip(sqlite_stages.started, names, runs):
        assert process.wait(timeout=START_S) == 0, sqlite_stages.stderr(name)
        assert "note:" not in sqlite_stages.stderr(name)
        assert client.get_run(run_id).info.status == "FINISHED"
    # This process as reproduce: its parent run RUNNING while its children are logged, and another stage meanwhile.
    parent = client.create_run(client.get_experiment_by_name(TRAIN_EXPERIMENT).experiment_id, tags=process_tags())
    mlflow.set_tracking_uri(sqlite_stages.env["MLFLOW_TRACKING_URI"])
    try:
        log_child_runs(parent.info.run_id, parent.info.experiment_id, "cora", [{"seed": 0, "test_acc": 0.8}],
                       {0: (time.time() - 1, time.time())}, {"dataset": "cora"})
    finally:
        mlflow.set_tracking_uri(None)
    (child,) = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert child.data.tags[PID_TAG] == str(os.getpid()) and child.data.tags[HOST_TAG] == socket.gethostname()
    code, lines = sqlite_stages.run_next("meanwhile")
    assert code == 0 and not lines, lines
    assert client.get_run(parent.info.run_id).info.status == "RUNNING"


def test_a_child_run_whose_logging_fails_ends_failed_not_running(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """reproduce logs each batch's children while its workers train, so a failure or a stop can come in the middle of
    one: that child ends FAILED (as the parent will), the ones before it stay FINISHED."""
    from stages.support.store import REPRODUCE_EXPERIMENT, connect
    from stages.support.tracking import log_child_runs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = connect(REPRODUCE_EXPERIMENT)
    client = MlflowClient()
    parent = client.create_run(experiment_id)
    now = time.time()
    rows = [{"seed": 0, "test_acc": 0.8}, {"seed": 1, "test_acc": None}]  # seed 1's metric is no number
    with pytest.raises(TypeError):
        log_child_runs(parent.info.run_id, experiment_id, "cora", rows, {0: (now - 2, now - 1), 1: (now - 1, now)},
                       {"dataset": "cora"})
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {run.info.run_name: run.info.status for run in children} == {"cora-seed-0": "FINISHED",
                                                                       "cora-seed-1": "FAILED"}
    assert client.get_run(parent.info.run_id).info.status == "RUNNING"  # the parent is its stage's to end


def test_a_killed_stages_run_is_ended_killed_on_the_server(server_stages: Stages, team_backend: TeamBackend) -> None:
    client = MlflowClient(team_backend.settings.tracking_uri)
    process, run_id = server_stages.start("killed")
    assert client.get_run(run_id).data.tags[PID_TAG] == str(process.pid)
    _killed(process)
    code, lines = server_stages.run_next("next")
    assert code == 0, lines
    assert lines == [_note([process.pid])]
    assert client.get_run(run_id).info.status == "KILLED"


# ------------------------------------------------------------------------------------ a frozen server (item 6)

def _family(pid: int) -> list[psutil.Process]:
    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


def _stopped_within(process: subprocess.Popen, server: int, act: Callable[[], None]) -> tuple[int, float]:
    """Freeze the MLflow server `server` and its workers (SIGSTOP), `act()`, and wait for `process` to exit:
    its exit code and how many seconds it took. The server is continued (SIGCONT) whatever happens."""
    frozen = _family(server)
    try:
        for member in frozen:
            member.suspend()
        act()
        started = time.monotonic()
        try:
            code = process.wait(timeout=FROZEN_STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the stage still waits for the frozen server {FROZEN_STOP_S:.0f} s later")
        return code, time.monotonic() - started
    finally:
        for member in frozen:
            member.resume()


def _frozen_line(uri: str) -> str:
    return (f"error: the MLflow tracking server at {uri} did not answer within 10 s (3 tries; "
            f"MLFLOW_HTTP_REQUEST_TIMEOUT) while logging to {TRAIN_EXPERIMENT}: it is stopped, frozen or overloaded; "
            "the run stays RUNNING until the next stage on this host that opens its experiment marks it KILLED and no "
            "output is written: check the server (`python -m team status`, its log), then rerun")


def test_a_frozen_server_stops_the_stage_in_one_line_and_the_next_stage_ends_its_run(
        server_stages: Stages, team_backend: TeamBackend) -> None:
    client = MlflowClient(team_backend.settings.tracking_uri)
    process, run_id = server_stages.start("frozen")
    server = team_backend.pids()["mlflow"]
    assert server is not None
    code, stopped_in = _stopped_within(process, server, lambda: server_stages.go("frozen"))
    lines = server_stages.stderr("frozen").strip().splitlines()
    assert code == 2 and lines == [_frozen_line(team_backend.settings.tracking_uri)], lines
    print(f"the stage stopped {stopped_in:.1f} s after the server froze")
    assert client.get_run(run_id).info.status == "RUNNING"
    code, lines = server_stages.run_next("next")
    assert code == 0 and lines == [_note([process.pid])], lines
    assert client.get_run(run_id).info.status == "KILLED"


def test_the_train_stage_stops_within_seconds_when_the_server_freezes_while_it_trains(
        team_pipeline: Pipeline, team_backend: TeamBackend, server_stages: Stages, tmp_path: Path) -> None:
    """The real train stage, frozen between two batches of epoch metrics (EpochLogger sends one per 100 epochs);
    the next stage ends the run it left RUNNING."""
    copy = team_pipeline.copy_to(tmp_path / "frozen")
    copy.set_params(**{"train.optim.max_epochs": 100000, "train.optim.patience": 100000})
    client = MlflowClient(team_backend.settings.tracking_uri)
    before = {run.info.run_id for run in client.search_runs(
        [client.get_experiment_by_name(TRAIN_EXPERIMENT).experiment_id], max_results=5000)}
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        stage = subprocess.Popen([str(VENV_BIN / "python"), "-m", "stages.train", "--data", "data/prepared/cora",
                                  "--out", str(tmp_path / "out")], cwd=copy.root, env=copy.env,
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        def training():
            runs = [run for run in client.search_runs([client.get_experiment_by_name(TRAIN_EXPERIMENT).experiment_id],
                                                      "attributes.status = 'RUNNING'", max_results=100)
                    if run.info.run_id not in before and "epoch_val_acc" in run.data.metrics]
            return runs[0] if runs else None

        assert _poll(lambda: stage.poll() is not None or training(), START_S, 0.5), err.read_text()[-3000:]
        assert stage.poll() is None, err.read_text()[-3000:]
        run = training()
        server = team_backend.pids()["mlflow"]
        assert server is not None
        code, stopped_in = _stopped_within(stage, server, lambda: None)
    finally:
        stage.kill()
        stage.wait(timeout=30)
    lines = [line for line in err.read_text().splitlines() if line.startswith("error:")]
    assert code == 2 and lines == [_frozen_line(team_backend.settings.tracking_uri)], err.read_text()[-3000:]
    assert "Traceback" not in err.read_text()
    assert not (tmp_path / "out").exists()
    print(f"the train stage stopped {stopped_in:.1f} s after the server froze")
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    code, lines = server_stages.run_next("next")
    assert code == 0 and lines == [_note([stage.pid])], lines
    assert client.get_run(run.info.run_id).info.status == "KILLED"


# --------------------------------------------------------------------------------------- the champion (item 10)

def _logged_models(uri: str, count: int) -> list[tuple[str, str]]:
    """`count` tiny PyTorch models, each logged in a run of the training experiment: (model_uri, run id)."""
    import mlflow
    import mlflow.pytorch
    import torch

    from stages.support.store import connect

    with pytest.MonkeyPatch.context() as patch:  # what was there before comes back, set or not
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        try:
            connect(TRAIN_EXPERIMENT)
            logged = []
            for n in range(count):
                with mlflow.start_run(experiment_id=MlflowClient().get_experiment_by_name(TRAIN_EXPERIMENT)
                                      .experiment_id, run_name=f"race-{n}") as run:
                    model = mlflow.pytorch.log_model(torch.nn.Linear(2, 2), name="model",
                                                     serialization_format="pickle", pip_requirements=[])
                logged.append((model.model_uri, run.info.run_id))
            return logged
        finally:
            mlflow.set_tracking_uri(None)


def _wait_ready(go: Path, evaluators: list[subprocess.Popen]) -> None:
    """Until every evaluator has imported MLflow and torch and waits for `go` (or one failed: shown later)."""
    _poll(lambda: len(list(go.parent.glob(f"{go.name}.ready-*"))) == len(evaluators)
          or any(process.poll() is not None for process in evaluators), START_S)


def _race(tmp_path: Path, env: dict[str, str], rounds: int) -> list[str]:
    """`rounds` times, four evaluations at once of the same four models with val_accs 0.70-0.85 under a fresh
    registered model name, the best one first in even rounds and last in odd ones: where `@champion` ended,
    as "right" or what went wrong."""
    uri = env["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri)
    models = _logged_models(uri, 4)
    script = tmp_path / "evaluator.py"
    script.write_text(EVALUATOR)
    val_accs = [0.70, 0.75, 0.80, 0.85]
    evaluator_env = env
    outcomes = []
    for round_ in range(rounds):
        name, go = f"gat-race-{uuid.uuid4().hex[:8]}", tmp_path / f"go-{round_}"
        delays = [0.3, 0.3, 0.3, 0.0] if round_ % 2 == 0 else [0.0, 0.1, 0.2, 1.5]
        evaluators = []
        try:
            for (model_uri, run_id), val_acc, delay in zip(models, val_accs, delays):
                evaluators.append(subprocess.Popen(
                    [str(VENV_BIN / "python"), str(script), model_uri, run_id, repr(val_acc), name, str(go),
                     str(delay)], cwd=REPO, env=evaluator_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True))
            _wait_ready(go, evaluators)
            go.touch()
            results = [process.communicate(timeout=START_S * 2) for process in evaluators]
        finally:
            for process in evaluators:
                process.kill()
        assert all(process.returncode == 0 for process in evaluators), [err[-2000:] for _, err in results]
        champion = client.get_model_version_by_alias(name, CHAMPION)
        right = float(champion.tags["val_acc"]) == max(val_accs)
        outcomes.append("right" if right else f"{name}: @champion on val_acc {champion.tags['val_acc']}; "
                                              f"{[out.strip() for out, _ in results]}")
    return outcomes


def test_concurrent_evaluations_leave_the_champion_on_the_best_model_on_the_server(
        tmp_path: Path, team_backend: TeamBackend) -> None:
    outcomes = _race(tmp_path, clean_env() | team_backend.mlflow_env, rounds=10)
    assert outcomes == ["right"] * 10, outcomes


@pytest.mark.slow  # about 25 s: 2 rounds of 4 evaluator processes
def test_concurrent_evaluations_leave_the_champion_on_the_best_model_in_sqlite(tmp_path: Path) -> None:
    env = clean_env() | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    outcomes = _race(tmp_path, env, rounds=2)
    assert outcomes == ["right"] * 2, outcomes


def _new_registered_model(tmp_path: Path, name: str) -> tuple[str, MlflowClient, Callable[..., Any]]:
    """A SQLite store in tmp_path with one logged model and the registered model `name`: its URI, a client, and
    `version(val_acc, pipeline=True)`, which registers the logged model again as a version of `name` with that
    val_acc (and, from the pipeline, its artifacts_sha256 and model_format tags)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (model_uri, run_id), = _logged_models(uri, 1)
    client = MlflowClient(uri)
    client.create_registered_model(name)
    source = client.get_logged_model(model_uri.removeprefix("models:/")).artifact_location

    def version(val_acc: str, pipeline: bool = True) -> Any:
        tags = {"val_acc": val_acc, "artifacts_sha256": "0" * 64, MODEL_FORMAT_TAG: MODEL_FORMAT} if pipeline else {
            "val_acc": val_acc}
        return client.create_model_version(name, source, run_id, tags=tags)

    return uri, client, version


def test_an_equal_newcomer_never_displaces_the_champion(tmp_path: Path) -> None:
    """Ties go to the oldest version, also when the alias was set on a newer one by a racing evaluation."""
    from stages.support.champion import settle_champion

    uri, client, version = _new_registered_model(tmp_path, "gat-tie")
    first, second = version("0.8"), version("0.8")
    version("0.9", pipeline=False)  # not the pipeline's
    client.set_registered_model_alias("gat-tie", CHAMPION, second.version)
    assert settle_champion(client, "gat-tie").version == first.version
    assert client.get_model_version_by_alias("gat-tie", CHAMPION).version == first.version


class _RacedClient(MlflowClient):
    """A client whose first set of the alias meets the race a server's store loses: another evaluation inserts
    the alias (on `rival`, or not at all when None) between the store's check and its own insert, and the store
    answers with the unique key's violation, as PostgreSQL did in CI."""

    def __init__(self, uri: str, rival: str | None) -> None:
        super().__init__(uri)
        self.rival, self.raced = rival, False

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        if not self.raced:
            self.raced = True
            if self.rival is not None:
                super().set_registered_model_alias(name, alias, self.rival)
            raise MlflowException('(psycopg2.errors.UniqueViolation) duplicate key value violates unique constraint '
                                  '"registered_model_alias_pk"', error_code=BAD_REQUEST)
        super().set_registered_model_alias(name, alias, version)


@pytest.mark.parametrize("rival_is_best", [False, True])
def test_an_alias_inserted_by_a_racing_evaluation_is_settled_not_a_failure(tmp_path: Path,
                                                                           rival_is_best: bool) -> None:
    from stages.support.champion import settle_champion

    uri, client, version = _new_registered_model(tmp_path, "gat-raced")
    worse, best = version("0.7"), version("0.8")
    raced = _RacedClient(uri, best.version if rival_is_best else worse.version)
    assert settle_champion(raced, "gat-raced").version == best.version
    assert raced.raced and client.get_model_version_by_alias("gat-raced", CHAMPION).version == best.version


def test_a_failed_alias_set_that_no_one_else_made_is_raised(tmp_path: Path) -> None:
    from stages.support.champion import settle_champion

    uri, _, version = _new_registered_model(tmp_path, "gat-refused")
    version("0.8")
    with pytest.raises(MlflowException, match="duplicate key"):
        settle_champion(_RacedClient(uri, rival=None), "gat-refused")


def test_a_refused_alias_set_is_raised_even_with_a_champion_in_place(tmp_path: Path) -> None:
    """A permission refusal is no lost race, though an alias exists (another evaluation's): it is raised at once,
    not retried until settle_champion gives up with "kept changing"."""
    from stages.support.champion import settle_champion

    class RefusedClient(MlflowClient):
        def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
            raise MlflowException("Permission denied", error_code=PERMISSION_DENIED)

    uri, client, version = _new_registered_model(tmp_path, "gat-read-only")
    client.set_registered_model_alias("gat-read-only", CHAMPION, version("0.7").version)
    version("0.8")
    with pytest.raises(MlflowException, match="Permission denied"):
        settle_champion(RefusedClient(uri), "gat-read-only")


def test_an_older_pipelines_champion_gives_way_and_is_never_loaded(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A champion an older pipeline registered (a pickled pytorch model: no model_format tag) keeps the alias
    against no model of today's format, even a worse one, and loading or serving it stops in one line."""
    from stages.support.champion import download_verified_model, promote_if_champion
    from stages.support.params import StageError

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (old_uri, old_run), (new_uri, new_run) = _logged_models(uri, 2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    client.create_registered_model("gat-upgraded")
    source = client.get_logged_model(old_uri.removeprefix("models:/")).artifact_location
    old = client.create_model_version("gat-upgraded", source, old_run, tags={"val_acc": "0.9",
                                                                             "artifacts_sha256": "0" * 64})
    client.set_registered_model_alias("gat-upgraded", CHAMPION, old.version)
    with pytest.raises(StageError, match=r"which an older pipeline registered .*`make repro` registers today's"):
        download_verified_model(f"models:/gat-upgraded@{CHAMPION}", tmp_path / "download")
    assert not (tmp_path / "download").exists() or not any((tmp_path / "download").iterdir())

    said = promote_if_champion(new_run, "gat-upgraded", new_uri, 0.8)
    champion = client.get_model_version_by_alias("gat-upgraded", CHAMPION)
    assert said.startswith("registered as gat-upgraded version 2, now `champion`"), said
    assert str(champion.version) == "2" and champion.tags[MODEL_FORMAT_TAG] == MODEL_FORMAT
    # From then on, the usual rule: an equal newcomer of today's format leaves it where it is.
    said = promote_if_champion(old_run, "gat-upgraded", new_uri, 0.8)
    assert said.startswith("champion stays gat-upgraded version 2"), said
