"""The end-to-end fixtures: the real `dvc repro` in a temporary git copy of the project, with tiny params.

- `pipeline` (session): a `Pipeline` where `dvc repro` has run once. Tests only read it.
- `pipeline_copy` (function): a private copy of that finished pipeline (git history, DVC cache, MLflow store
  and all), for a test that changes params, reruns stages or interrupts them. Tests never depend on each
  other's changes, so they run in any order.

The data comes over a loopback HTTP server (GAT_DATA_MIRROR): the real Cora and Citeseer files when
../shared has them, synthetic Planetoid-format files otherwise. MLflow uses the copy's default store,
`sqlite:///<copy>/mlflow.db`, with artifacts in `<copy>/mlartifacts`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from conftest import PlanetoidFolder, serving
from mlflow.tracking import MlflowClient

from benchmarks.scale import set_params
from gat.config import Params

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# The datasets dvc.yaml's foreach stages run over: params.yaml's `datasets`.
DATASETS = tuple(yaml.safe_load((REPO / "params.yaml").read_text())["datasets"])

# Small enough to train in seconds; everything else is the repo's params.yaml. The single training run
# stops early (patience 5 of at most 60 epochs), so its restored epoch is not its last.
TINY = {"train.optim.max_epochs": 60, "train.optim.patience": 5, "analyze.tsne_max_iter": 250, "reproduce.seeds": 3,
        "reproduce.seeds_per_batch": 2, "train.optim.kernel": "fused",
        **{f"reproduce.protocol.{name}.optim.{key}": value for name in DATASETS
           for key, value in (("max_epochs", 12), ("patience", 4), ("kernel", "fused"))}}


class Pipeline:
    """A throwaway clone of the project and the commands a user would type in it."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env
        self.client = MlflowClient(self.tracking_uri)

    @property
    def tracking_uri(self) -> str:
        return self.env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.root / 'mlflow.db'}"

    def run(self, *command: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        done = subprocess.run(command, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            pytest.fail(f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def dvc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(str(VENV_BIN / "dvc"), *args, check=check)

    def python(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(str(VENV_BIN / "python"), *args, check=check)

    def set_params(self, **dotted: object) -> None:
        set_params(self.root, **dotted)

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

    def copy_to(self, root: Path) -> "Pipeline":
        """A private copy: the same files, history, DVC cache and MLflow runs, rooted at `root`."""
        shutil.copytree(self.root, root, symlinks=True, ignore=shutil.ignore_patterns("tmp"))
        if not (root / "mlflow.db").exists():  # a pipeline logging to a server
            return Pipeline(root, dict(self.env))
        # The store records absolute artifact locations; point the copy's at its own folder.
        with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as db, db:
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                for column in db.execute(f"PRAGMA table_info('{table}')").fetchall():
                    if column[2].upper().startswith(("VARCHAR", "TEXT")):
                        db.execute(f'UPDATE "{table}" SET "{column[1]}" = replace("{column[1]}", ?, ?)',
                                   (str(self.root), str(root)))
        return Pipeline(root, dict(self.env))


def ran(result: subprocess.CompletedProcess) -> list[str]:
    """The stages that `dvc repro` ran, in order."""
    return [line.split("'")[1] for line in result.stdout.splitlines() if line.startswith("Running stage")]


def copy_project(root: Path, planetoid_folder: PlanetoidFolder) -> None:
    """The repository's tracked and untracked-but-not-ignored files, as a user's clone would have them."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / "dvc.lock").unlink(missing_ok=True)
    if not planetoid_folder.real:
        # The pinned checksums and sizes are the real files'; synthetic data gets its own pinned lists.
        shutil.copy(planetoid_folder.path / "SHA256SUMS", root / "gat/planetoid.sha256")
        shutil.copy(planetoid_folder.sizes, root / "gat/planetoid.sizes")


def clean_env() -> dict[str, str]:
    """This process's environment without MLflow's, DVC's and the project's settings, nor PYTHONPATH: every process
    a test starts imports the project as installed, or from the checkout it runs in (cwd, `python -m`). Nor the CA
    that a team test's own `requests` trust (REQUESTS_CA_BUNDLE): the project's processes must pass the team's CA on
    themselves."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DVC_", "GAT_")) and k not in ("PYTHONPATH", "REQUESTS_CA_BUNDLE")}
    return env | {"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "MLFLOW_DISABLE_TELEMETRY": "true",
                  "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
                  "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"}


@pytest.fixture(scope="session")
def planetoid_server(planetoid_folder: PlanetoidFolder) -> Iterator[str]:
    with serving(planetoid_folder.path) as server:
        yield server.base_url


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory: pytest.TempPathFactory, planetoid_folder: PlanetoidFolder,
             planetoid_server: str) -> Pipeline:
    root = tmp_path_factory.mktemp("gat-repro")
    copy_project(root, planetoid_folder)
    pipeline = Pipeline(root, clean_env() | {"GAT_DATA_MIRROR": planetoid_server})
    pipeline.set_params(**TINY)
    pipeline.run("git", "init", "-q", "-b", "main")
    pipeline.commit("copy of the project under test")
    pipeline.first = pipeline.dvc("repro")
    pipeline.commit("first repro")
    return pipeline


@pytest.fixture
def pipeline_copy(pipeline: Pipeline, tmp_path: Path) -> Pipeline:
    return pipeline.copy_to(tmp_path / "gat-repro")
