"""Team mode against the real servers: PostgreSQL, SeaweedFS and `mlflow server` with basic-auth (team_support).

Who may reach what (the threat model) is tested in test_team_security.py."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests
from pipeline_support import REPO, VENV_BIN, Pipeline, clean_env, ran
from readme_support import process_tree, stop_all
from team_support import TeamBackend, server_runs, with_team_remote

from stages.support.store import DATA_EXPERIMENT, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT
from team.ports import choose_ports
from team.settings import ARTIFACTS_BUCKET, DVC_BUCKET

QUEUE_TIMEOUT_S = 900


def _stage(pipeline: Pipeline, out: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """The train stage by hand, in the team pipeline's folder, writing to `out`."""
    return subprocess.run([str(VENV_BIN / "python"), "-m", "stages.train", "--data", "data/prepared/cora",
                           "--out", str(out)], cwd=pipeline.root, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _new_runs(backend: TeamBackend, experiment: str, before: set[str]) -> list:
    return [run for run in server_runs(backend, experiment) if run.info.run_id not in before]


def _ids(backend: TeamBackend, experiment: str) -> set[str]:
    return {run.info.run_id for run in server_runs(backend, experiment)}


# ------------------------------------------------------------------------------------------- the pipeline

def test_every_stage_logs_to_the_server_and_nothing_to_sqlite(team_pipeline: Pipeline,
                                                              team_backend: TeamBackend) -> None:
    assert ran(team_pipeline.first)[:2] == ["download@cora", "download@citeseer"]
    assert not (team_pipeline.root / "mlflow.db").exists()
    assert not (team_pipeline.root / "mlartifacts").exists()
    data_runs = {run.info.run_name for run in server_runs(team_backend, DATA_EXPERIMENT)}
    assert {"download-cora", "download-citeseer", "preprocess-cora", "preprocess-citeseer"} <= data_runs
    trained = json.loads((team_pipeline.root / "data/train/run.json").read_text())
    train_run = team_pipeline.client.get_run(trained["run_id"])
    assert train_run.info.status == "FINISHED"
    metrics = json.loads((team_pipeline.root / "data/eval/metrics.json").read_text())
    assert {key: train_run.data.metrics[key] for key in metrics} == pytest.approx(metrics)
    reproduced = [run for run in server_runs(team_backend, REPRODUCE_EXPERIMENT)
                  if run.info.run_id in team_pipeline.reproduce_runs]
    parents = [run for run in reproduced if "mlflow.parentRunId" not in run.data.tags]
    assert sorted(run.data.tags["dataset"] for run in parents) == ["citeseer", "cora"]
    seeds = team_pipeline.params().reproduce.seeds
    for parent in parents:
        children = [run for run in reproduced if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(run.info.run_name for run in children) == sorted(
            f"{parent.data.tags['dataset']}-seed-{seed}" for seed in range(seeds))
        assert all(run.info.status == "FINISHED" for run in [parent, *children])


def test_registering_against_the_server_prints_none_of_mlflows_registry_lines(team_pipeline: Pipeline) -> None:
    shown = team_pipeline.first.stdout + team_pipeline.first.stderr
    assert "registered as gat-cora version" in shown or "champion stays gat-cora" in shown
    for noise in ("Waiting up to", "already exists", "Created version", "Downloading artifacts"):
        assert noise not in shown


def test_models_are_objects_in_the_bucket_and_load_through_the_server(team_pipeline: Pipeline,
                                                                      team_backend: TeamBackend,
                                                                      tmp_path: Path) -> None:
    trained = json.loads((team_pipeline.root / "data/train/run.json").read_text())
    model_id = trained["model_uri"].removeprefix("models:/")
    keys = team_backend.objects(ARTIFACTS_BUCKET)
    assert any(model_id in key and key.endswith("MLmodel") for key in keys), keys[:20]
    # The weights and the graph as tensor files (stages/support/served_model.py), beside the model's code.
    assert any(model_id in key and key.endswith("/model.pt") for key in keys)
    assert any(model_id in key and key.endswith("/graph.pt") for key in keys)
    assert any(trained["run_id"] in key and key.endswith("training_curves.png") for key in keys)
    # The README's snippet, outside the repository, with only the MLflow settings: no S3 credentials.
    lines = (team_pipeline.root / "data/eval/predictions.csv").read_text().splitlines()[1:]
    nodes, _actual, predicted = zip(*(map(int, line.split(",")) for line in lines))
    snippet = ("import json, mlflow\n"
               f"model = mlflow.pyfunc.load_model('runs:/{trained['run_id']}/gat-cora')\n"
               f"print(json.dumps(model.predict({list(nodes)}).argmax(-1).tolist()))\n")
    env = {k: v for k, v in clean_env().items() if not k.startswith("AWS_")} | team_backend.mlflow_env
    env["TMPDIR"] = str(tmp_path)  # MLflow downloads the model into a temporary folder of its own and leaves it there
    server_log = team_backend.state.logs / "mlflow.log"
    logged_before = len(server_log.read_text(errors="replace").splitlines())
    done = subprocess.run([str(VENV_BIN / "python"), "-c", snippet], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == list(predicted)
    # MLflow 3 asks for the run's own copy of the model first (there is none) and retries the server's error answer:
    # 3 tries with `.team/env`'s request settings; MLflow's defaults made it 8, over about 4 minutes.
    logged = server_log.read_text(errors="replace").splitlines()[logged_before:]
    asked = [line for line in logged if f"{trained['run_id']}/artifacts/gat-cora " in line and '" 500' in line]
    assert 1 <= len(asked) <= 3, logged[:60]


def test_no_secret_reaches_git_or_the_logged_runs(team_pipeline: Pipeline, team_backend: TeamBackend) -> None:
    assert stat.S_IMODE(team_backend.state.env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(team_backend.state.settings_file.stat().st_mode) == 0o600
    assert subprocess.run(["git", "check-ignore", "-q", ".team/env"], cwd=REPO).returncode == 0
    tracked = team_pipeline.run("git", "ls-files").stdout.split()
    assert ".dvc/config.local" not in tracked
    assert team_backend.settings.s3_secret_key in (team_pipeline.root / ".dvc/config.local").read_text()
    secrets = [team_backend.settings.admin_password, team_backend.settings.s3_secret_key,
               team_backend.settings.db_password]
    for experiment in (TRAIN_EXPERIMENT, DATA_EXPERIMENT, REPRODUCE_EXPERIMENT):
        for run in server_runs(team_backend, experiment):
            values = [*run.data.params.values(), *run.data.tags.values()]
            assert not any(secret in value for secret in secrets for value in values)
    for log in team_backend.state.logs.iterdir():
        assert not any(secret in log.read_text(errors="replace") for secret in secrets), log.name


# ------------------------------------------------------------------------------------------------- DVC

def test_a_colleague_pulls_everything_and_retrains_nothing(team_pipeline: Pipeline, team_backend: TeamBackend,
                                                           tmp_path: Path) -> None:
    team_pipeline.dvc("push", "--run-cache")
    assert team_backend.objects(DVC_BUCKET)
    colleague_root = tmp_path / "colleague"
    subprocess.run(["git", "clone", "-q", str(team_pipeline.root), str(colleague_root)], check=True)
    colleague = Pipeline(colleague_root, clean_env() | team_backend.mlflow_env)
    with_team_remote(colleague, team_backend)
    colleague.dvc("pull")
    repro = colleague.dvc("repro")
    assert ran(repro) == [], repro.stdout
    assert "up to date" in repro.stdout
    for output in ("data/train/model.pt", "data/eval/metrics.json", "data/reproduce/cora/seeds.csv"):
        assert (colleague_root / output).read_bytes() == (team_pipeline.root / output).read_bytes()


def test_experiments_travel_through_a_git_remote_with_their_data(team_pipeline: Pipeline,
                                                                 team_backend: TeamBackend,
                                                                 tmp_path: Path) -> None:
    mine = team_pipeline.copy_to(tmp_path / "mine")
    bare = tmp_path / "shared.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    mine.run("git", "remote", "add", "origin", str(bare))
    mine.run("git", "push", "-q", "origin", "main")
    mine.dvc("exp", "run", "-n", "lr-01", "-S", "train.optim.lr=0.01")
    mine.dvc("exp", "push", "origin", "lr-01")
    metrics = (mine.root / "data/eval/metrics.json").read_bytes()

    theirs_root = tmp_path / "theirs"
    subprocess.run(["git", "clone", "-q", str(bare), str(theirs_root)], check=True)
    theirs = Pipeline(theirs_root, clean_env() | team_backend.mlflow_env)
    with_team_remote(theirs, team_backend)
    theirs.dvc("exp", "pull", "origin", "lr-01")
    assert "lr-01" in theirs.dvc("exp", "list", "--name-only").stdout
    theirs.dvc("exp", "apply", "lr-01")
    assert (theirs_root / "data/eval/metrics.json").read_bytes() == metrics
    assert ran(theirs.dvc("repro", "train", "evaluate")) == []


# --------------------------------------------------------------------------------------------- concurrency

def _start_queue_workers(pipeline: Pipeline, jobs: int, log: Path) -> list[int]:
    """`dvc queue start -j jobs`, and the PIDs of the workers it forked.

    Its output goes to a file, not a pipe: dvc_task forks each worker from the `dvc queue start` process, so the
    forks keep that process's stdout open until they exit, and a pipe would make the call wait for the whole
    queue and for every worker's idle shutdown (the CI run of b9aec68 waited 600 s on a worker that never
    stopped, DVC's known `-j` race: treeverse/dvc#10673)."""
    with log.open("w") as out:
        subprocess.run([str(VENV_BIN / "dvc"), "queue", "start", "-j", str(jobs)], cwd=pipeline.root,
                       env=pipeline.env, stdout=out, stderr=subprocess.STDOUT, timeout=120, check=True)
    # Each fork writes its worker's PID file once the worker has started, after `dvc queue start` returned.
    pid_files = [pipeline.root / f".dvc/tmp/exps/celery/dvc-exp-worker-{number}.pid" for number in range(1, jobs + 1)]
    deadline = time.monotonic() + 60
    while not all(path.is_file() and path.read_text().strip() for path in pid_files):
        assert time.monotonic() < deadline, f"no worker PID files after 60 s: {log.read_text()}"
        time.sleep(0.2)
    return [int(path.read_text()) for path in pid_files]


def _queue_diagnosis(pipeline: Pipeline, status: str) -> str:
    """What a failed queue test shows: the queue's status and the tail of every worker's log."""
    logs = sorted((pipeline.root / ".dvc/tmp/exps/celery").glob("*.out"))
    tails = ["\n".join([f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-15:]]) for log in logs]
    return "\n".join([status, *tails])


def _stop_queue_workers(pipeline: Pipeline, pids: list[int]) -> None:
    """`dvc queue stop --kill`, then stop by PID each worker (and what it started) that outlives that by 30 s.

    DVC's shutdown is a message through its file-system broker, which the first worker's `--clean` may delete
    before the others read it; a worker that misses it idles forever."""
    workers = [process for pid in pids for process in process_tree(pid)]
    pipeline.dvc("queue", "stop", "--kill", check=False)
    _gone, alive = psutil.wait_procs(workers, timeout=30)
    stop_all(alive)


def test_four_queued_experiments_land_once_each(team_pipeline: Pipeline, team_backend: TeamBackend,
                                                tmp_path: Path) -> None:
    copy = team_pipeline.copy_to(tmp_path / "queue")
    before = _ids(team_backend, TRAIN_EXPERIMENT)
    rates = ("0.002", "0.004", "0.006", "0.008")
    for rate in rates:
        copy.dvc("exp", "run", "--queue", "-S", f"train.optim.lr={rate}")
    workers = _start_queue_workers(copy, 2, tmp_path / "queue-start.log")
    try:
        deadline = time.monotonic() + QUEUE_TIMEOUT_S
        while time.monotonic() < deadline:
            status = copy.dvc("queue", "status").stdout
            if not any(word in status for word in ("Queued", "Running")):
                break
            time.sleep(3)
        else:
            pytest.fail(f"the queue did not finish in {QUEUE_TIMEOUT_S} s:\n{_queue_diagnosis(copy, status)}")
    finally:
        _stop_queue_workers(copy, workers)
    assert status.count("Success") == 4, _queue_diagnosis(copy, status)
    new = _new_runs(team_backend, TRAIN_EXPERIMENT, before)
    assert len(new) == 4, [run.info.run_name for run in new]
    assert all(run.info.status == "FINISHED" and "test_acc" in run.data.metrics for run in new)
    assert len({run.data.tags.get("dvc_exp_name") for run in new} - {None}) == 4
    assert sorted(run.data.params["train.optim.lr"] for run in new) == sorted(rates)


def test_two_reproduce_stages_at_once_lose_no_child(team_pipeline: Pipeline, team_backend: TeamBackend,
                                                    tmp_path: Path) -> None:
    copy = team_pipeline.copy_to(tmp_path / "two")
    seeds = 6
    copy.set_params(**{"reproduce.seeds": seeds, "reproduce.workers": 1})
    before = _ids(team_backend, REPRODUCE_EXPERIMENT)
    stages = [subprocess.Popen([str(VENV_BIN / "python"), "-m", "stages.reproduce", "--dataset", "cora", "--data",
                                "data/prepared/cora", "--out", str(tmp_path / f"out-{i}")], cwd=copy.root,
                               env=copy.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    try:
        errors = [stage.communicate(timeout=600)[1] for stage in stages]
    finally:
        for stage in stages:
            stage.kill()
    assert [stage.returncode for stage in stages] == [0, 0], errors
    new = _new_runs(team_backend, REPRODUCE_EXPERIMENT, before)
    parents = [run for run in new if "mlflow.parentRunId" not in run.data.tags]
    assert len(parents) == 2
    for parent in parents:
        children = [run for run in new if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(run.info.run_name for run in children) == sorted(f"cora-seed-{s}" for s in range(seeds))
    assert len(new) == 2 + 2 * seeds


# --------------------------------------------------------------------------------------------------- faults

def _assert_one_line_and_nothing_written(done: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("who", ["wrong-password", "unknown-user"])
def test_bad_credentials_fail_at_once_naming_the_server(team_pipeline: Pipeline, team_backend: TeamBackend,
                                                        tmp_path: Path, who: str) -> None:
    env = team_pipeline.env | {"MLFLOW_TRACKING_PASSWORD": "not-the-password"}
    if who == "unknown-user":
        env["MLFLOW_TRACKING_USERNAME"] = "nobody-here"
    before = _ids(team_backend, TRAIN_EXPERIMENT)
    done = _stage(team_pipeline, tmp_path / "out", env, timeout=60)
    _assert_one_line_and_nothing_written(done, tmp_path / "out", team_backend.settings.tracking_uri,
                                         "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    assert _new_runs(team_backend, TRAIN_EXPERIMENT, before) == []


def test_a_read_only_user_may_read_but_not_log(team_pipeline: Pipeline, team_backend: TeamBackend,
                                               tmp_path: Path) -> None:
    uri, admin = team_backend.settings.tracking_uri, ("admin", team_backend.settings.admin_password)
    created = requests.post(f"{uri}/api/2.0/mlflow/users/create",
                            json={"username": "reader", "password": "read-only-pass-12"}, auth=admin, timeout=30)
    assert created.status_code == 200 or "already exists" in created.text, created.text
    env = team_pipeline.env | {"MLFLOW_TRACKING_USERNAME": "reader", "MLFLOW_TRACKING_PASSWORD": "read-only-pass-12"}
    readable = requests.get(f"{uri}/api/2.0/mlflow/experiments/get-by-name",
                            params={"experiment_name": TRAIN_EXPERIMENT}, auth=("reader", "read-only-pass-12"),
                            timeout=30)
    assert readable.status_code == 200
    before = _ids(team_backend, TRAIN_EXPERIMENT)
    done = _stage(team_pipeline, tmp_path / "out", env, timeout=120)
    _assert_one_line_and_nothing_written(done, tmp_path / "out", "PERMISSION_DENIED", "reader", uri)
    assert _new_runs(team_backend, TRAIN_EXPERIMENT, before) == []


def test_an_unreachable_server_fails_fast_naming_its_uri(team_pipeline: Pipeline, tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    done = _stage(team_pipeline, tmp_path / "out", team_pipeline.env | {"MLFLOW_TRACKING_URI": uri}, timeout=60)
    _assert_one_line_and_nothing_written(done, tmp_path / "out", uri, "unreachable")


def test_the_object_store_down_fails_the_run_and_writes_nothing(team_pipeline: Pipeline, team_backend: TeamBackend,
                                                                seaweedfs_stopped: None, tmp_path: Path) -> None:
    before = _ids(team_backend, TRAIN_EXPERIMENT)
    done = _stage(team_pipeline, tmp_path / "out", team_pipeline.env, timeout=300)
    _assert_one_line_and_nothing_written(done, tmp_path / "out", team_backend.settings.tracking_uri, "FAILED",
                                         "could not store an artifact (is its object store up?)")
    (run,) = _new_runs(team_backend, TRAIN_EXPERIMENT, before)
    assert run.info.status == "FAILED"


# ------------------------------------------------------------------------------------------ team up / down

def test_team_up_when_up_is_a_no_op_that_says_so(team_backend: TeamBackend) -> None:
    pids = team_backend.pids()
    done = team_backend.team("up", "--no-dvc-remote")
    assert done.returncode == 0, done.stderr
    assert "already up" in done.stdout
    assert team_backend.pids() == pids


@pytest.mark.team
def test_a_temporary_backend_serves_its_clients_and_stops_by_pid_after_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """team.backend.temporary_backend, which the benchmarks track into: a whole backend in a new folder whose clients'
    settings reach its MLflow server, every server stopped when the block ends, here with an error."""
    import shutil
    import tempfile

    from mlflow.tracking import MlflowClient

    from team.backend import running, temporary_backend
    from team.settings import State

    root = Path(tempfile.mkdtemp(prefix="gat-team-temporary-"))  # not tmp_path (0700): PostgreSQL's user must reach it
    state = State(root / "team")
    try:
        with pytest.raises(RuntimeError, match="the benchmark failed"), temporary_backend(root / "team") as env:
            pids = running(state)
            assert all(pids.values()), pids
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            assert MlflowClient(env["MLFLOW_TRACKING_URI"]).get_experiment_by_name(REPRODUCE_EXPERIMENT) is not None
            raise RuntimeError("the benchmark failed")

        def alive(pid: int) -> bool:  # a killed server that this process started stays a zombie until reaped
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        assert not [pid for pid in pids.values() if alive(pid)]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_team_up_refuses_a_port_in_use_naming_it(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        state = tmp_path / "state"
        done = subprocess.run([str(VENV_BIN / "python"), "-m", "team", "up", "--state", str(state), "--no-dvc-remote"],
                              cwd=REPO, env=clean_env() | {"GAT_TEAM_MLFLOW_PORT": str(port)}, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: port {port} (GAT_TEAM_MLFLOW_PORT) is in use on 127.0.0.1: free it, or "
                                   "set GAT_TEAM_MLFLOW_PORT to another port (unset, a free one is picked)")
    assert not (state / "run").exists() and not (state / "postgres").exists()


def test_a_taken_port_from_last_time_is_replaced(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = choose_ports({"mlflow": port})
    assert ports["mlflow"] != port and len(set(ports.values())) == len(ports)
    assert f"port {port} (mlflow) is in use on 127.0.0.1: using {ports['mlflow']} instead" in capsys.readouterr().out


def test_the_env_file_is_what_a_client_needs(team_backend: TeamBackend) -> None:
    sourced = subprocess.run(["bash", "-c", f"source {team_backend.state.env_file} && env"], capture_output=True,
                             text=True, check=True, env={"PATH": os.environ["PATH"]}).stdout
    values = dict(line.split("=", 1) for line in sourced.splitlines() if "=" in line)
    assert values["MLFLOW_TRACKING_URI"] == team_backend.settings.tracking_uri
    assert values["MLFLOW_TRACKING_USERNAME"] == "admin"
    assert values["GAT_TEAM_S3_ENDPOINT"] == team_backend.settings.s3_endpoint
    answer = requests.get(f"{values['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search",
                          params={"max_results": 1}, timeout=30,
                          auth=(values["MLFLOW_TRACKING_USERNAME"], values["MLFLOW_TRACKING_PASSWORD"]))
    assert answer.status_code == 200
    assert requests.get(f"{values['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search",
                        params={"max_results": 1}, timeout=30).status_code == 401


def test_make_ui_with_the_settings_sourced_prints_the_servers_pages(team_backend: TeamBackend) -> None:
    done = subprocess.run(["make", "-s", "ui"], cwd=REPO, env=clean_env() | team_backend.mlflow_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    uri = team_backend.settings.tracking_uri
    assert done.stdout.startswith("Open these pages on the team's MLflow server"), done.stdout
    assert f"{uri}/#/experiments/" in done.stdout and "workflowType=machine_learning" in done.stdout
