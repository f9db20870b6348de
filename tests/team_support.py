"""Team-mode fixtures: the real backend (PostgreSQL, SeaweedFS, `mlflow server`) and a pipeline logging to it.

- `team_backend` (session): `python -m team up --state <tmp>`, exactly what `make team-up` runs, in a state
  folder of its own; `python -m team down` at the end, which must leave no process and no listener behind.
  It changes nothing in this process: the admin's credentials are in its environment only during a test that
  uses the backend (`team_credentials`, autouse), for MlflowClient.
- `team_pipeline` (session): the tiny pipeline run by `make repro`'s two commands against that server, with
  the copy's DVC remote on the backend's S3 bucket. Tests only read it, or copy it (`copy_to`).
- `seaweedfs_stopped` (function): the object store stopped for one test, started again afterwards and checked
  healthy (its S3 API answers with both buckets), so that every later test finds the store as the session made it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from pipeline_support import REPO, TINY, VENV_BIN, Pipeline, clean_env, copy_project

from stages.support.store import REPRODUCE_EXPERIMENT
from team.backend import running
from team.servers import s3_client
from team.settings import ARTIFACTS_BUCKET, DVC_BUCKET, Settings, State


@dataclass
class TeamBackend:
    state: State
    settings: Settings

    @property
    def client_env(self) -> dict[str, str]:
        """What `source .team/env` sets."""
        return self.state.client_env(self.settings)

    @property
    def mlflow_env(self) -> dict[str, str]:
        """Only what an MLflow client needs: the server and the account, no S3 credentials."""
        return {key: value for key, value in self.client_env.items() if key.startswith("MLFLOW_")}

    def s3(self):
        return s3_client(self.settings.s3_endpoint, self.settings.s3_access_key, self.settings.s3_secret_key,
                         self.state.ca_file)

    def objects(self, bucket: str) -> list[str]:
        keys: list[str] = []
        for page in self.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return keys

    def team(self, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
        """`python -m team <args> --state <this backend's folder>`."""
        return subprocess.run([str(VENV_BIN / "python"), "-m", "team", *args, "--state", str(self.state.root)],
                              cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)

    def pids(self) -> dict[str, int | None]:
        return running(self.state)


@contextlib.contextmanager
def credentials(backend: TeamBackend) -> Iterator[None]:
    """The admin's MLflow credentials in this process's environment for the block, for MlflowClient, and the team's
    CA as the one `requests` trusts (REQUESTS_CA_BUNDLE), for the tests' own calls to the servers' APIs; what was
    there before is restored. (The project's own processes never see REQUESTS_CA_BUNDLE: they pass the CA on.)"""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in backend.mlflow_env.items():
            if key != "MLFLOW_TRACKING_URI":
                patch.setenv(key, value)
        patch.setenv("REQUESTS_CA_BUNDLE", str(backend.state.ca_file))
        yield


@pytest.fixture(autouse=True)
def team_credentials(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test that uses the team backend, and for it alone, the admin's credentials in the environment (see
    `credentials`); every other test runs with the environment it was started with, whatever ran before it."""
    if "team_backend" not in request.fixturenames:
        yield
        return
    with credentials(request.getfixturevalue("team_backend")):
        yield


def healthy(backend: TeamBackend, timeout: float = 60.0) -> bool:
    """Every server of the backend runs and SeaweedFS's S3 API answers (both buckets there), within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if all(backend.pids().values()):
                names = {bucket["Name"] for bucket in backend.s3().list_buckets()["Buckets"]}
                if {ARTIFACTS_BUCKET, DVC_BUCKET} <= names:
                    return True
        except Exception:  # not up yet: botocore's and the OS's errors alike
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="session")
def team_backend() -> Iterator[TeamBackend]:
    # Not under pytest's tmp_path (mode 0700): as root, PostgreSQL runs as another user, who must reach it.
    root = Path(tempfile.mkdtemp(prefix="gat-team-"))
    root.chmod(0o755)
    state = State(root)
    backend = None
    try:
        started = subprocess.run([str(VENV_BIN / "python"), "-m", "team", "up", "--state", str(root),
                                  "--no-dvc-remote"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                                 timeout=400)
        assert started.returncode == 0, f"team up failed:\n{started.stdout}\n{started.stderr}"
        settings = state.load()
        assert settings is not None
        backend = TeamBackend(state, settings)
        yield backend
    finally:
        groups = [proc for pid in running(state).values() if pid for proc in _family(pid)]
        stopped = subprocess.run([str(VENV_BIN / "python"), "-m", "team", "down", "--state", str(root)], cwd=REPO,
                                 env=clean_env(), capture_output=True, text=True, timeout=120)
        # The recorded servers, and any process still working in the state folder: a server whose record a failed
        # start replaced, or that a failed `down` lost, is stopped too, by PID, before the checks below fail.
        leftovers = list({proc.pid: proc for proc in [*groups, *_working_in(root)] if _alive(proc)}.values())
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        ports = backend.settings.ports.values() if backend else []
        still_listening = [port for port in ports if _listening(port)]
        shutil.rmtree(root, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr
        assert not leftovers, f"team down left processes running: {[p.cmdline() for p in leftovers]}"
        assert not still_listening, f"team down left ports listening: {still_listening}"


def _family(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def _working_in(root: Path) -> list[psutil.Process]:
    """The processes whose working directory is `root` or inside it (the team's servers run there)."""
    found = []
    for process in psutil.process_iter(["cwd"]):
        cwd = process.info["cwd"]  # None where it can't be read
        if cwd and Path(cwd).is_relative_to(root):
            found.append(process)
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(scope="session")
def team_pipeline(tmp_path_factory: pytest.TempPathFactory, planetoid_folder, planetoid_server: str,
                  team_backend: TeamBackend) -> Pipeline:
    root = tmp_path_factory.mktemp("gat-repro-team")
    copy_project(root, planetoid_folder)
    pipeline = Pipeline(root, clean_env() | {"GAT_DATA_MIRROR": planetoid_server} | team_backend.mlflow_env)
    pipeline.set_params(**TINY)
    pipeline.run("git", "init", "-q", "-b", "main")
    pipeline.commit("copy of the project under test")
    # `make repro`'s two commands, with `.team/env` sourced.
    pipeline.python("-m", "tools.init_store")
    # The server is the session's: tests that ran before this fixture (in any order) may have logged reproduce runs.
    with credentials(team_backend):
        earlier = {run.info.run_id for run in server_runs(team_backend, REPRODUCE_EXPERIMENT)}
    pipeline.first = pipeline.dvc("repro")
    pipeline.commit("first repro")
    # The reproduce runs this repro made: not the earlier tests', nor those of tests that run later.
    with credentials(team_backend):
        pipeline.reproduce_runs = {run.info.run_id for run in server_runs(team_backend, REPRODUCE_EXPERIMENT)} - earlier
    # `make team-remote`: the copy's DVC remote is the backend's bucket, in .dvc/config.local.
    with_team_remote(pipeline, team_backend)
    return pipeline


def with_team_remote(pipeline: Pipeline, backend: TeamBackend) -> None:
    """`source .team/env && make team-remote` in another clone."""
    subprocess.run([str(VENV_BIN / "python"), "-m", "team", "remote", "--repo", str(pipeline.root)], cwd=REPO,
                   env=clean_env() | backend.client_env, check=True, capture_output=True, text=True)


@pytest.fixture
def seaweedfs_stopped(team_backend: TeamBackend) -> Iterator[None]:
    from team.processes import stop_server

    assert healthy(team_backend), "the object store was not healthy before the test stopped it"
    assert stop_server(team_backend.state, "seaweedfs")
    try:
        yield
    finally:
        # Left as found: the same store (its data folder, ports and buckets) answering again, for every later test.
        started = team_backend.team("up", "--no-dvc-remote")
        assert started.returncode == 0, started.stdout + started.stderr
        assert healthy(team_backend), f"SeaweedFS did not come back healthy:\n{started.stdout}"


def server_runs(backend: TeamBackend, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(backend.settings.tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return client.search_runs([found.experiment_id], order_by=["start_time ASC"], max_results=5000)
