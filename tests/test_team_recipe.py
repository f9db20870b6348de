"""The README's team recipe for two people, run as written: Alice hosts the backend, Bob clones and pulls.

The numbered steps of the README's team section are parsed from the README (each a person's bash block), so the
test cannot drift from it. Alice and Bob each get a shell of their own (tests/readme_support.py) in one folder that
holds a bare git repository (the group's git remote, the only placeholder substituted), Alice's clone `gat-repro`
(tiny params, pushed) and, once Bob's `git clone` has run, Bob's `gat-repro-bob`. One backend: the one Alice's
`make team-up` starts in her clone; the fixture stops it by PID whatever happens (`python -m team down`, then
SIGKILL for anything left).

About 5 minutes on a 2-core machine: the tiny pipeline once (`make team-repro`), the backend's start, a push and
a pull.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import requests
from pipeline_support import REPO, TINY, VENV_BIN, clean_env, copy_project, ran, set_params
from readme_support import (ReadmeShell, as_if_make_made_the_venv, bash_blocks, process_tree, readme_section,
                            stop_all)

from stages.support.store import DATA_EXPERIMENT, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT
from team.backend import running
from team.settings import State

HEADING = "## Team mode: one MLflow server, one object store, shared experiments"
REMOTE = "<the group's git remote>"
RECIPE_S = 1200.0  # the longest command, `make team-repro`: the tiny pipeline on a busy 2-core machine


def _recipe() -> list[tuple[str, list[str]]]:
    """The numbered steps of the README's team section: who runs them, and the commands of their bash block."""
    section = readme_section(HEADING)
    steps = re.findall(r"^\d+\. \*\*(Alice|Bob|Both)\*\*(.*?)(?=^\S|\Z)", section, re.M | re.S)
    recipe = []
    for who, text in steps:
        (block,) = bash_blocks(text)
        recipe.append((who, block))
    return recipe


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def team_recipe_folder(planetoid_folder) -> Iterator[Path]:
    """The folder of the recipe: `origin.git` (the group's git remote) and Alice's clone `gat-repro` of it, with tiny
    params; the backend her `make team-up` starts there is stopped at the end, by PID, and nothing may listen."""
    # Not under pytest's tmp_path (mode 0700): as root, PostgreSQL runs as another user, who must reach .team/.
    folder = Path(tempfile.mkdtemp(prefix="gat-team-recipe-"))
    folder.chmod(0o755)
    seed = folder / "seed"
    copy_project(seed, planetoid_folder)
    set_params(seed, **TINY)
    env = clean_env()
    for command in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "the project"],
                    ["git", "init", "-q", "--bare", "-b", "main", str(folder / "origin.git")],
                    ["git", "push", "-q", str(folder / "origin.git"), "main"],
                    ["git", "clone", "-q", str(folder / "origin.git"), str(folder / "gat-repro")]):
        subprocess.run(command, cwd=seed, env=env, check=True, capture_output=True)
    shutil.rmtree(seed)
    as_if_make_made_the_venv(folder / "gat-repro")
    state = State(folder / "gat-repro" / ".team")
    try:
        yield folder
    finally:
        processes = [process for pid in running(state).values() if pid for process in process_tree(pid)]
        settings = state.load()
        stopped = subprocess.run([str(VENV_BIN / "python"), "-m", "team", "down", "--state", str(state.root)],
                                 cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
        leftovers = [process for process in processes if _alive(process)]
        stop_all(leftovers, timeout=5)
        listening = [port for port in (settings.ports.values() if settings else []) if _listening(port)]
        shutil.rmtree(folder, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr
        assert not leftovers, f"the backend left processes running: {[p.pid for p in leftovers]}"
        assert not listening, f"the backend left ports listening: {listening}"


def test_two_people_follow_the_readme_recipe(team_recipe_folder: Path, planetoid_server: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice: `make team-up`, `make team-repro` (every stage's runs on the server; without .team/env it refuses),
    commit and push dvc.lock, `dvc push`; Bob: clone, her settings, `make team-remote`, `dvc pull` (her outputs,
    byte for byte, and nothing to rerun), her model loaded from the server; both: the pages of `make ui` and the
    browser's login (admin and the password .team/env exports); Alice: `make team-down`, which stops everything."""
    from mlflow.tracking import MlflowClient

    recipe = _recipe()
    assert [who for who, _ in recipe] == ["Alice", "Alice", "Bob", "Both", "Alice"], recipe
    assert recipe[-1][1] == ["make team-down"]
    assert any(REMOTE in command for _, block in recipe for command in block)
    folder = team_recipe_folder
    alice_root, bob_root = folder / "gat-repro", folder / "gat-repro-bob"
    replace = {REMOTE: str(folder / "origin.git")}
    alice = ReadmeShell(folder, clean_env() | {"GAT_DATA_MIRROR": planetoid_server}, tmp_path, replace)
    bob = ReadmeShell(folder, clean_env(), tmp_path, replace)
    # Before the recipe: `make team-repro` without the team's settings runs nothing, in one line (make adds its own).
    refused = subprocess.run(["make", "-s", "team-repro"], cwd=alice_root, env=clean_env(), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.splitlines()[0] == (
        "error: MLFLOW_TRACKING_URI names no tracking server: `source .team/env` (written by `make team-up`) first"), \
        refused.stderr
    assert not (alice_root / "data").exists()
    said: dict[str, subprocess.CompletedProcess] = {}
    for who, block in recipe[:-1]:
        for name, shell in (("Alice", alice), ("Bob", bob)):
            if who not in (name, "Both"):
                continue
            for command in block:
                done = shell.run(command, timeout=RECIPE_S)
                assert done is not None and "Traceback" not in done.stdout + done.stderr, done
                said[f"{name}: {command}"] = done
                if command.startswith("git clone"):
                    as_if_make_made_the_venv(bob_root)

    # Alice's stages all ran, each logging to her server, none to a local store.
    state = State(alice_root / ".team")
    settings = state.load()
    assert settings is not None
    uri, password = settings.tracking_uri, settings.admin_password
    login = f"log in as admin, password: MLFLOW_TRACKING_PASSWORD in {state.env_file}"
    assert login in said["Alice: make team-up"].stdout
    assert {"train", "evaluate", "reproduce@cora", "report"} <= set(ran(said["Alice: make team-repro"]))
    assert not (alice_root / "mlflow.db").exists() and not (alice_root / "mlartifacts").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(state.ca_file))
    client = MlflowClient(uri)

    def runs(experiment: str) -> list:
        found = client.get_experiment_by_name(experiment)
        assert found is not None, experiment
        return client.search_runs([found.experiment_id], max_results=1000)

    trained = json.loads((alice_root / "data/train/run.json").read_text())
    assert client.get_run(trained["run_id"]).info.status == "FINISHED"
    assert {"download-cora", "preprocess-citeseer"} <= {run.info.run_name for run in runs(DATA_EXPERIMENT)}
    parents = [run for run in runs(REPRODUCE_EXPERIMENT) if "mlflow.parentRunId" not in run.data.tags]
    assert sorted(run.data.tags["dataset"] for run in parents) == ["citeseer", "cora"]
    # Not in the recipe: plain `make repro` where the pipeline has run finds it up to date and logs nothing, which
    # is why the README's first step says `make team-repro`.
    before = {run.info.run_id for experiment in (TRAIN_EXPERIMENT, DATA_EXPERIMENT) for run in runs(experiment)}
    again = alice.run("make repro", timeout=RECIPE_S)
    assert again is not None and ran(again) == [] and "up to date" in again.stdout, again.stdout
    assert {run.info.run_id for experiment in (TRAIN_EXPERIMENT, DATA_EXPERIMENT) for run in runs(experiment)} == before

    # Bob has Alice's outputs, byte for byte, and nothing to rerun; her champion loads, checked, from the server.
    assert _git_log(bob_root) == _git_log(alice_root)
    assert "Data and pipelines are up to date." in said["Bob: dvc status"].stdout
    for output in ("data/train/model.pt", "data/eval/metrics.json", "data/reproduce/cora/seeds.csv"):
        assert (bob_root / output).read_bytes() == (alice_root / output).read_bytes(), output
    rerun = bob.run("dvc repro", timeout=RECIPE_S)
    assert rerun is not None and ran(rerun) == [], rerun.stdout
    (loaded,) = [done for command, done in said.items() if command.startswith("Bob: python -c")]
    assert re.fullmatch(r"\[\d+ \d+\]", loaded.stdout.strip()), loaded.stdout  # two nodes' predicted classes

    # Both: the server's pages, and the login a browser asks for (it answers 401 with a Basic challenge).
    for name in ("Alice", "Bob"):
        assert f"{uri}/#/experiments/" in said[f"{name}: make ui"].stdout
        assert said[f'{name}: echo "$MLFLOW_TRACKING_PASSWORD"'].stdout.strip() == password
    ca = str(state.ca_file)
    anonymous = requests.get(f"{uri}/", timeout=30, verify=ca)
    assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"].startswith("Basic")
    assert requests.get(f"{uri}/", auth=("admin", password), timeout=30, verify=ca).status_code == 200
    assert requests.get(f"{uri}/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                        auth=("admin", password), timeout=30, verify=ca).status_code == 200
    status = alice.run("make team-status")
    assert status is not None and f"MLflow at {uri} (log in as admin, password: MLFLOW_TRACKING_PASSWORD" \
        in status.stdout, status.stdout

    # Alice stops the backend: no process of it left, no port listening.
    pids = [pid for pid in running(state).values() if pid]
    processes = [process for pid in pids for process in process_tree(pid)]
    assert len(pids) == 3
    (command,) = recipe[-1][1]
    alice.run(command)
    assert not [process for process in processes if _alive(process)]
    assert not [port for port in settings.ports.values() if _listening(port)]


def _git_log(clone: Path) -> str:
    return subprocess.run(["git", "log", "--format=%H %s", "-3"], cwd=clone, capture_output=True, text=True,
                          check=True).stdout
