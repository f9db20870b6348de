"""`reproduce.executor: dask`: seed batches on a real Dask cluster give the local executor's results, byte for byte.

A module fixture (`dask_cluster`) starts `dask scheduler` and two `dask worker --nthreads 1` processes on
127.0.0.1, dashboards off, as the README's multi-host recipe does, and stops them, with every process they
started, at the end. Against it, with tiny params, in private copies of the session's pipeline
(tests/pipeline_support.py): a byte-identical seeds.csv, a worker SIGKILLed mid-run, SIGTERM to the stage.
The scheduler and workers run from a folder that is no checkout, without PYTHONPATH: they import the project as
the venv has it installed (the scheduler needs none of its code). On a scheduler and a worker of a
test's own (`doomed_cluster`): the scheduler SIGKILLed mid-run, or every worker, is a one-line error. Without a
cluster: an unreachable scheduler, and the LocalCluster the stage starts when no scheduler is named (its
results, and Ctrl-C).

The README's Dask recipes, run as written (on free ports, all on 127.0.0.1): the queued 2 × 2 sweep through a
scheduler and workers started with its exact command lines, then `make compare`; workers of an environment without the
project and, on the README's command lines, a worker whose fused kernel is off are one-line errors, and so is a worker
started in another checkout. A local worker that falls back to the torch kernel is refused too.

Every wait is a poll with a deadline; no test asserts a duration.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import distributed
import psutil
import pytest
from conftest import WITH_DEFAULT_SIGNALS
from pipeline_support import REPO, TINY, VENV_BIN, Pipeline, clean_env
from readme_support import STAGE_S, ReadmeShell, process_tree, readme_blocks, stop_all, unclaimable_ports

from stages.support.store import COMPARE_EXPERIMENT, REPRODUCE_EXPERIMENT

START_S = 120.0  # how long a scheduler, a worker or a stage may take to start on a busy 2-core machine
# Long enough seeds that a worker can be killed while it trains one: patience = max_epochs, so each seed
# trains exactly max_epochs epochs (seconds of Cora).
LONG = {"reproduce.seeds": 4, "reproduce.seeds_per_batch": 1, "reproduce.protocol.cora.optim.max_epochs": 600,
        "reproduce.protocol.cora.optim.patience": 600}
FOREVER = {"reproduce.seeds": 4, "reproduce.seeds_per_batch": 1,
           "reproduce.protocol.cora.optim.max_epochs": 100000, "reproduce.protocol.cora.optim.patience": 100000}


def _poll(condition: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


@dataclass
class DaskCluster:
    """A scheduler and its workers, started as a user would, and a client to look at them."""

    address: str
    folder: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    def client(self) -> Any:
        return distributed.Client(self.address, timeout=30, set_as_default=False)

    def worker_pids(self, client: Any) -> dict[str, int]:
        return client.run(os.getpid)

    def executing(self, client: Any) -> dict[str, int]:
        """Per worker, how many tasks are running on it now."""
        return client.run(lambda dask_worker: dask_worker.state.executing_count)

    def wait_for_workers(self, count: int = 2) -> None:
        with self.client() as client:
            client.wait_for_workers(count, timeout=START_S)

    def idle(self) -> bool:
        """No task of a stage is left on the scheduler, nor running on a worker."""
        with self.client() as client:
            left = client.run_on_scheduler(lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks
                                                                   if str(k).startswith("train_seeds")])
            return not left and not any(self.executing(client).values())


def _log(folder: Path, name: str) -> Any:
    return (folder / f"{name}.log").open("w")


@contextlib.contextmanager
def _cluster(folder: Path, workers: tuple[str, ...], python: Path = VENV_BIN / "python") -> Iterator[DaskCluster]:
    """`dask scheduler` and `dask worker --nthreads 1` processes named `workers`, of the environment of `python`
    (the venv's, where the project is installed), started in `folder` (not a checkout) without PYTHONPATH: they
    import the task as installed. At the end, every process they started is stopped."""
    env = clean_env()
    started: list[subprocess.Popen] = []
    try:
        scheduler_file = folder / "scheduler.json"
        started.append(subprocess.Popen(
            [str(python), "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)],
            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=_log(folder, "scheduler")))
        assert _poll(lambda: scheduler_file.is_file() and scheduler_file.stat().st_size > 0, START_S), \
            (folder / "scheduler.log").read_text()
        time.sleep(0.2)  # the file is written in one go, but let it be closed
        address = json.loads(scheduler_file.read_text())["address"]
        for name in workers:
            started.append(subprocess.Popen(
                [str(python), "-m", "dask", "worker", address, "--nthreads", "1", "--nworkers", "1", "--no-dashboard",
                 "--dashboard-address", "127.0.0.1:0", "--host", "127.0.0.1", "--name", name,
                 "--local-directory", str(folder / name)],
                cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=_log(folder, name)))
        cluster = DaskCluster(address, folder, started)
        cluster.wait_for_workers(len(workers))
        yield cluster
    finally:
        everything = [process for popen in started for process in process_tree(popen.pid)]
        stop_all(everything)
        assert not [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskCluster]:
    """The module's scheduler and two workers (started once: seconds each on a busy machine)."""
    with _cluster(tmp_path_factory.mktemp("dask"), ("worker-a", "worker-b")) as cluster:
        yield cluster


@pytest.fixture
def dask_cluster(shared_cluster: DaskCluster) -> Iterator[DaskCluster]:
    """The module's cluster as every test must find it, whichever ran before: both workers there (a nanny restarts
    a worker a test killed) and no task of an earlier stage left on it; and so a test leaves it."""
    shared_cluster.wait_for_workers(2)
    assert _poll(shared_cluster.idle, 60, 0.5), "an earlier test left tasks on the module's cluster"
    yield shared_cluster
    assert _poll(shared_cluster.idle, 60, 0.5), "the test left tasks on the module's cluster"


@pytest.fixture
def doomed_cluster(tmp_path: Path) -> Iterator[DaskCluster]:
    """A scheduler and one worker of the test's own, for a test that kills them."""
    folder = tmp_path / "doomed-cluster"
    folder.mkdir()
    with _cluster(folder, ("worker-a",)) as cluster:
        yield cluster


@pytest.fixture
def copy(pipeline: Pipeline, tmp_path: Path) -> Pipeline:
    """A private copy of the session's pipeline for the test's own stage runs: no test sees another's params,
    runs or outputs."""
    return pipeline.copy_to(tmp_path / "gat-repro")


def _reproduce(pipeline: Pipeline, out: Path, *, address: str | None, check: bool = True,
               extra_env: dict[str, str] | None = None, **params: object) -> subprocess.CompletedProcess:
    """`python -m stages.reproduce` for cora in `pipeline` with `params`, on the cluster at `address`."""
    pipeline.set_params(**params)
    env = {k: v for k, v in pipeline.env.items() if k != "DASK_SCHEDULER_ADDRESS"} | (extra_env or {})
    if address is not None:
        env["DASK_SCHEDULER_ADDRESS"] = address
    done = subprocess.run(_reproduce_command(out), cwd=pipeline.root, env=env, capture_output=True, text=True,
                          timeout=STAGE_S)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _reproduce_command(out: Path) -> list[str]:
    return [str(VENV_BIN / "python"), "-m", "stages.reproduce", "--dataset", "cora", "--data", "data/prepared/cora",
            "--out", str(out)]


def _start_reproduce(pipeline: Pipeline, address: str, out: Path, stderr: Path) -> subprocess.Popen:
    """reproduce@cora against the scheduler at `address`, in the background; its stderr goes to `stderr`."""
    env = {**pipeline.env, "DASK_SCHEDULER_ADDRESS": address}
    with stderr.open("w") as err:
        return subprocess.Popen(_reproduce_command(out), cwd=pipeline.root, env=env, stdout=subprocess.DEVNULL,
                                stderr=err)


def _reset(pipeline: Pipeline, **params: object) -> None:
    """The session pipeline's tiny params (what its `dvc repro` ran with), the local executor, then `params`."""
    pipeline.set_params(**({**TINY, "reproduce.executor": "local", "reproduce.workers": 0} | params))


def _parents(pipeline: Pipeline) -> list:
    return [run for run in pipeline.runs(REPRODUCE_EXPERIMENT) if "mlflow.parentRunId" not in run.data.tags]


def _children(pipeline: Pipeline, parent_id: str) -> list:
    return [run for run in pipeline.runs(REPRODUCE_EXPERIMENT) if run.data.tags.get("mlflow.parentRunId") == parent_id]


def _local_seeds_csv(pipeline: Pipeline, tmp_path: Path) -> bytes:
    """seeds.csv as the local executor writes it for `pipeline`'s current params (two worker processes)."""
    _reproduce(pipeline, tmp_path / "local", address=None, **{"reproduce.executor": "local",
                                                                "reproduce.seeds_per_batch": 2,
                                                                "reproduce.workers": 2})
    return (tmp_path / "local" / "seeds.csv").read_bytes()


# ------------------------------------------------------------------------------------------------ results

def _where_it_imports(folder: Path) -> list[str]:
    """The files of the project that the venv's python imports, started in `folder` without PYTHONPATH."""
    done = subprocess.run([str(VENV_BIN / "python"), "-c", "import gat, stages.support.seed_task as task; "
                           "print(gat.__file__); print(task.__file__)"], cwd=folder, env=clean_env(),
                          capture_output=True, text=True, timeout=START_S, check=True)
    return done.stdout.split()


def test_external_workers_write_the_local_seeds_csv_byte_for_byte(copy: Pipeline, dask_cluster: DaskCluster,
                                                                  tmp_path: Path) -> None:
    """`dask scheduler` and two `dask worker` processes, started from a folder that is no checkout and without
    PYTHONPATH, import the project as installed and run a reproduction. The session's `dvc repro` ran the local
    executor (2 processes, 2 seeds per batch); here one seed per task on the cluster's two workers: the same
    seeds.csv, byte for byte. Each child run records where its seed ran."""
    with dask_cluster.client() as client:
        def where() -> tuple[str, str | None, str]:
            import stages.support.seed_task

            return os.getcwd(), os.environ.get("PYTHONPATH"), stages.support.seed_task.__file__

        seen = client.run(where)
        on_scheduler = client.run_on_scheduler(lambda: (os.getcwd(), os.environ.get("PYTHONPATH")))
    assert len(seen) == 2
    installed = _where_it_imports(tmp_path)[1]
    for cwd, pythonpath, task in seen.values():
        assert pythonpath is None and Path(cwd) == dask_cluster.folder  # not a checkout
        assert not (Path(cwd) / "stages").exists() and task == installed
    assert on_scheduler == (str(dask_cluster.folder), None)
    _reset(copy)
    local = (copy.root / "data/reproduce/cora/seeds.csv").read_bytes()
    before = {run.info.run_id for run in _parents(copy)}
    done = _reproduce(copy, tmp_path / "dask", address=dask_cluster.address,
                      **{"reproduce.executor": "dask", "reproduce.seeds_per_batch": 1})
    assert (tmp_path / "dask/seeds.csv").read_bytes() == local
    header = local.decode().splitlines()[0].split(",")
    assert header == ["seed", "test_acc", "val_acc", "epochs", "best_epoch", "weights_sha256"]
    assert f"on the Dask scheduler at {dask_cluster.address}" in done.stderr
    (parent,) = [run for run in _parents(copy) if run.info.run_id not in before]
    assert parent.data.tags["executor"] == "dask" and parent.data.tags["dask_scheduler"] == dask_cluster.address
    assert parent.data.tags["workers_resolved"] == "2"
    children = _children(copy, parent.info.run_id)
    rows = [line.split(",") for line in local.decode().splitlines()[1:]]
    assert sorted((c.data.tags["seed"], c.data.tags["weights_sha256"]) for c in children) == sorted(
        (row[0], row[-1]) for row in rows)
    # Where the work ran is not part of the experiment: DVC sees nothing to rerun.
    assert "up to date" in copy.dvc("status", "reproduce@cora").stdout
    for child in children:
        tags = child.data.tags
        assert tags["worker_address"].startswith("tcp://127.0.0.1:")
        assert tags["worker_host"] == socket.gethostname() and tags["torch_threads"] == "1"
        assert tags["torch_version"] and tags["torch_cpu_capability"] and tags["code_sha256"]
        assert set(child.data.metrics) == {"test_acc", "val_acc", "epochs", "best_epoch"}


def test_a_local_cluster_writes_the_same_seeds_csv(copy: Pipeline, tmp_path: Path) -> None:
    """No scheduler named: the stage starts a LocalCluster of `reproduce.workers` processes (here 1, with all
    three seeds in one batch) and stops it, leaving no process behind."""
    _reset(copy)
    local = (copy.root / "data/reproduce/cora/seeds.csv").read_bytes()
    done = _reproduce(copy, tmp_path / "cluster", address=None, **{
        "reproduce.executor": "dask", "reproduce.workers": 1, "reproduce.seeds_per_batch": 3})
    assert (tmp_path / "cluster/seeds.csv").read_bytes() == local
    assert "on a LocalCluster of 1 single-threaded workers" in done.stderr

    def left_behind() -> list[psutil.Process]:  # the cluster's processes run where the stage ran
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.cwd() == str(copy.root) and process.pid != os.getpid():
                    found.append(process)
        return found

    assert _poll(lambda: not left_behind(), 10), [p.cmdline() for p in left_behind()]


def test_the_local_cluster_settings_yield_to_the_users() -> None:
    """Where the user set one of LOCAL_CLUSTER_CONFIG's keys, the stage's LocalCluster keeps the user's value."""
    import dask

    from stages.support.dask_pool import LOCAL_CLUSTER_CONFIG, local_cluster_config

    assert local_cluster_config() == LOCAL_CLUSTER_CONFIG  # Dask's defaults here: the stage's values apply
    with dask.config.set({"distributed.admin.tick.interval": "50ms", "distributed.worker.profile.enabled": False}):
        kept = local_cluster_config()
    assert "distributed.admin.tick.interval" not in kept
    assert kept["distributed.worker.memory.monitor-interval"] == "500ms"


def test_a_local_cluster_starts_in_the_background_and_never_outlives_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """starting_dask_pool: the workers run with the stage's settings; an error before the pool is asked for
    still closes the cluster started for it, and a normal end too, leaving no process behind."""
    import dask

    from stages.support.dask_pool import starting_dask_pool

    monkeypatch.setenv("GAT_DASK_DASHBOARD", "off")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    me = psutil.Process()
    others = set(me.children(recursive=True))

    def ours() -> list[psutil.Process]:  # multiprocessing's resource tracker lives as long as this process: not ours
        found = []
        for process in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process not in others and process.status() != psutil.STATUS_ZOMBIE and \
                        "resource_tracker" not in " ".join(process.cmdline()):
                    found.append(process)
        return found

    with dask.config.set({"scheduler-address": None}):
        with pytest.raises(RuntimeError, match="the stage failed"):
            with starting_dask_pool(1):
                raise RuntimeError("the stage failed")  # before the pool is asked for: it is closed all the same
        assert _poll(lambda: not ours(), 30), [p.cmdline() for p in ours()]

        with starting_dask_pool(1) as starting, starting.pool() as pool:
            settings = pool.client.run(lambda: (dask.config.get("distributed.worker.profile.enabled"),
                                                os.environ.get("MALLOC_TRIM_THRESHOLD_")))
            assert list(settings.values()) == [(False, None)]
        assert _poll(lambda: not ours(), 30), [p.cmdline() for p in ours()]


# A stage whose main module notes each process that imports it; its one job is defined in it or elsewhere (argv[1]).
MAIN_IMPORT_STAGE = '''
import os, sys
with open("imported.txt", "a") as noted:
    noted.write(f"{os.getpid()}\\n")
from stages.support.dask_pool import dask_pool

def job():
    return os.getpid()

if __name__ == "__main__":
    with dask_pool(1) as pool:
        worker = pool.client.submit(job if sys.argv[1] == "main" else os.getpid, pure=False).result()
    print(f"parent {os.getpid()} worker {worker}", flush=True)
'''


@pytest.mark.parametrize("job_in", ["main", "elsewhere"])
def test_local_cluster_workers_skip_the_stages_main_module(tmp_path: Path, job_in: str) -> None:
    """As the local pool's (test_lifecycle), a LocalCluster's workers do not import the stage's main module (for
    `python -m stages.reproduce`: MLflow, matplotlib), and a job defined there still reaches them, by value."""
    (tmp_path / "stage.py").write_text(MAIN_IMPORT_STAGE)
    env = {k: v for k, v in clean_env().items() if not k.startswith("DASK_")} | {"GAT_DASK_DASHBOARD": "off"}
    done = subprocess.run([str(VENV_BIN / "python"), "stage.py", job_in], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=START_S)
    assert done.returncode == 0, done.stderr
    parent, worker = done.stdout.split()[1::2]
    assert parent != worker
    assert (tmp_path / "imported.txt").read_text().split() == [parent]


def test_the_ablation_estimate_follows_the_measured_costs() -> None:
    """benchmarks.scale's model on made-up times: T(W) = 10 s + 100 worker-s / W."""
    from benchmarks.scale import ablation_wall_s, fit

    fixed, compute = fit(110.0, 60.0)
    assert (fixed, compute) == (10.0, 100.0)
    one, _ = ablation_wall_s(fixed, compute, batches=25, stage_runs=100, workers=1)
    assert 100 * 100 <= one <= 100 * 110  # all the compute in turn; the fixed costs partly overlap
    many, at_once = ablation_wall_s(fixed, compute, batches=25, stage_runs=100, workers=64)
    assert at_once >= 3  # 25 batches per stage: one experiment can't keep 64 workers busy
    assert 100 * 100 / 64 < many < one / 20
    assert fit(50.0, 60.0) == (70.0, 0.0)  # 2 workers slower than 1: no compute to spread


# ------------------------------------------------------------------------------------------------- faults

def test_a_worker_killed_mid_run_changes_nothing(copy: Pipeline, dask_cluster: DaskCluster, tmp_path: Path) -> None:
    """SIGKILL to the worker process that is training a seed: Dask runs that batch again elsewhere; the stage
    finishes with the local executor's seeds.csv and exactly one child run per seed."""
    _reset(copy, **LONG)
    local = _local_seeds_csv(copy, tmp_path)
    dask_cluster.wait_for_workers(2)
    before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
    copy.set_params(**{"reproduce.executor": "dask", "reproduce.seeds_per_batch": 1})
    err = tmp_path / "stderr.txt"
    stage = _start_reproduce(copy, dask_cluster.address, tmp_path / "dask", err)
    try:
        with dask_cluster.client() as client:
            pids = dask_cluster.worker_pids(client)
            busy: list[str] = []
            deadline = time.monotonic() + START_S
            while not busy and stage.poll() is None and time.monotonic() < deadline:
                busy = [worker for worker, running in dask_cluster.executing(client).items() if running]
                time.sleep(0.05)
            assert busy and stage.poll() is None, f"no worker was seen training a seed:\n{err.read_text()}"
            os.kill(pids[busy[0]], signal.SIGKILL)
        assert stage.wait(timeout=STAGE_S) == 0, err.read_text()
    finally:
        stage.kill()
        stage.wait()
    assert (tmp_path / "dask/seeds.csv").read_bytes() == local
    fresh = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    (parent,) = [run for run in fresh if "mlflow.parentRunId" not in run.data.tags]
    children = _children(copy, parent.info.run_id)
    assert sorted(int(run.data.tags["seed"]) for run in children) == [0, 1, 2, 3]  # none twice, none missing
    assert {run.info.status for run in fresh} == {"FINISHED"}
    assert len(fresh) == 1 + 4


def test_an_unreachable_scheduler_is_a_one_line_error(copy: Pipeline, tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port with nothing behind it
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
    _reset(copy)
    done = _reproduce(copy, tmp_path / "out", address=address, check=False, **{"reproduce.executor": "dask"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach the Dask scheduler at {address}"), done.stderr
    assert "DASK_SCHEDULER_ADDRESS" in lines[0]
    (parent,) = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    assert parent.info.status == "FAILED"
    assert not (tmp_path / "out").exists()


def test_sigterm_cancels_the_tasks_on_the_workers(copy: Pipeline, dask_cluster: DaskCluster, tmp_path: Path) -> None:
    """The stage stops, its run ends FAILED, and the workers drop its running tasks (they poll for it each epoch)."""
    dask_cluster.wait_for_workers(2)
    _reset(copy, **FOREVER, **{"reproduce.executor": "dask"})
    before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
    err = tmp_path / "stderr.txt"
    stage = _start_reproduce(copy, dask_cluster.address, tmp_path / "out", err)
    try:
        with dask_cluster.client() as client:
            assert _poll(lambda: stage.poll() is not None or all(dask_cluster.executing(client).values()),
                         START_S, 0.2), err.read_text()
        assert stage.poll() is None, err.read_text()
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        stage.kill()
        stage.wait()
    assert _poll(dask_cluster.idle, 30, 0.5), "the workers kept training for a stage that is gone"
    fresh = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    assert [run.info.status for run in fresh] == ["FAILED"]
    assert not (tmp_path / "out").exists()
    assert "interrupted by SIGTERM" in err.read_text() and "Traceback" not in err.read_text()


def _killed_mid_run(copy: Pipeline, cluster: DaskCluster, tmp_path: Path, kill: Callable[[], None],
                    timeout: float) -> str:
    """reproduce@cora on `cluster`, `kill()` once its batches train: the stage ends with exit 2 and one line
    within `timeout`, the run FAILED, no output written and no process of the stage left; its last line."""
    _reset(copy, **FOREVER, **{"reproduce.executor": "dask"})
    before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
    err = tmp_path / "stderr.txt"
    stage = _start_reproduce(copy, cluster.address, tmp_path / "out", err)
    processes: list[psutil.Process] = []
    try:
        with cluster.client() as client:
            assert _poll(lambda: stage.poll() is not None or all(cluster.executing(client).values()), START_S, 0.2), \
                err.read_text()
        assert stage.poll() is None, err.read_text()
        processes = process_tree(stage.pid)
        kill()
        assert stage.wait(timeout=timeout) == 2, err.read_text()
    finally:
        stage.kill()
        stage.wait()
    text = err.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and text.strip().splitlines()[-1] == errors[0], text
    assert "Traceback" not in text, text
    fresh = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    assert [run.info.status for run in fresh] == ["FAILED"]
    assert not (tmp_path / "out").exists()
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return errors[0]


def test_a_scheduler_killed_mid_run_is_a_one_line_error(copy: Pipeline, doomed_cluster: DaskCluster,
                                                        tmp_path: Path) -> None:
    """The client loses the scheduler and Dask cancels every task (FutureCancelledError): one line, not a traceback."""
    scheduler = doomed_cluster.processes[0]
    line = _killed_mid_run(copy, doomed_cluster, tmp_path, scheduler.kill, timeout=120)
    assert line.startswith(f"error: the Dask scheduler at {doomed_cluster.address} went away during the run "
                           "(FutureCancelledError): restart it"), line


def test_a_run_whose_workers_all_died_is_a_one_line_error(copy: Pipeline, doomed_cluster: DaskCluster,
                                                          tmp_path: Path) -> None:
    """Dask would wait for a worker forever: the stage gives up after WORKERS_S without one."""
    from stages.support.dask_pool import WORKERS_S

    def kill_workers() -> None:
        for popen in doomed_cluster.processes[1:]:
            for process in process_tree(popen.pid):
                with contextlib.suppress(psutil.Error):
                    process.kill()

    line = _killed_mid_run(copy, doomed_cluster, tmp_path, kill_workers, timeout=WORKERS_S + 120)
    assert line.startswith(f"error: the Dask scheduler at {doomed_cluster.address} has had no workers for "
                           f"{WORKERS_S:.0f} s during the run"), line


def test_ctrl_c_stops_a_local_cluster_and_its_workers(copy: Pipeline, tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group, the LocalCluster's workers included: one message, the run FAILED,
    no process left."""
    _reset(copy, **FOREVER, **{"reproduce.executor": "dask", "reproduce.workers": 1})
    before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        stage = subprocess.Popen(
            [*WITH_DEFAULT_SIGNALS, *_reproduce_command(tmp_path / "out")],
            cwd=copy.root, env={**copy.env, "GAT_DASK_DASHBOARD": "off"}, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True)
    processes: list[psutil.Process] = []
    try:
        def training() -> bool:  # the worker process is busy: its CPU time grows
            tree = process_tree(stage.pid)
            processes.extend(p for p in tree if p not in processes)
            return "LocalCluster" in err.read_text() and any(
                p.cpu_times().user > 5 for p in tree[1:] if "spawn_main" in " ".join(p.cmdline()))

        assert _poll(lambda: stage.poll() is not None or training(), START_S, 0.5), err.read_text()
        os.killpg(stage.pid, signal.SIGINT)
        assert stage.wait(timeout=60) == 128 + signal.SIGINT
        assert _poll(lambda: not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
                     10), "a process of the stage's cluster outlived it"
    finally:
        stop_all([p for p in [*processes, *process_tree(stage.pid)] if p.is_running()], timeout=1)
    lines = err.read_text().strip().splitlines()
    assert lines[-1] == ("error: interrupted by SIGINT: stopping; the MLflow run is marked FAILED and no output is "
                         "written."), err.read_text()
    assert len(lines) == 2 and "Traceback" not in err.read_text()  # the cluster line, then the stop
    fresh = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    assert [run.info.status for run in fresh] == ["FAILED"]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- the README's recipes

def _readme_dask_blocks() -> list[list[str]]:
    return readme_blocks("## Scaling out: seeds and sweeps on a Dask cluster")


class DaskShell(ReadmeShell):
    """A ReadmeShell where the README's scheduler and dashboard ports are free ones, so that nothing clashes with
    another test."""

    def __init__(self, root: Path, env: dict[str, str], folder: Path) -> None:
        scheduler, dashboard = unclaimable_ports(2)
        super().__init__(root, env, folder, replace={"8786": str(scheduler), "8787": str(dashboard)})

    def line(self, command: str) -> str:
        if command.startswith("dask scheduler") or " dask worker " in f" {command}":
            assert all(port in command for port in self.replace if "scheduler" in command or port == "8786"), \
                f"a README port that the test cannot move: {command}"
        return super().line(command)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.replace['8786']}"

    def wait_for_workers(self, count: int) -> None:
        """Until `count` workers are on the scheduler. A background command that ended (a scheduler that could not
        start) fails at once, and every failure shows the background commands' logs."""
        port = int(self.replace["8786"])

        def listening() -> bool:
            assert all(popen.poll() is None for popen in self.background), self.background_logs()
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0

        assert _poll(listening, START_S, 0.5), f"nothing listens on {self.address}\n{self.background_logs()}"
        try:
            with distributed.Client(self.address, timeout=START_S, set_as_default=False) as client:
                client.wait_for_workers(count, timeout=START_S)
        except (OSError, TimeoutError) as error:
            raise AssertionError(f"{count} workers did not join {self.address}: {error}\n"
                                 f"{self.background_logs()}") from error


@pytest.fixture
def readme_shell(tmp_path: Path) -> Iterator[Callable[[Pipeline], DaskShell]]:
    """A DaskShell in a pipeline copy whose `.venv` is the test's own (as `make repro` would have made it)."""
    shells: list[DaskShell] = []

    def make(pipeline: Pipeline) -> DaskShell:
        (pipeline.root / ".venv").symlink_to(VENV_BIN.parent)
        with (pipeline.root / ".git/info/exclude").open("a") as exclude:
            exclude.write(".venv\n")  # .gitignore's `.venv/` matches a folder, not this link
        shells.append(DaskShell(pipeline.root, pipeline.env, tmp_path))
        return shells[-1]

    try:
        yield make
    finally:
        for shell in shells:
            shell.stop()


def test_the_readme_sweep_runs_as_written(pipeline_copy: Pipeline, readme_shell: Callable[[Pipeline], DaskShell],
                                          tmp_path: Path) -> None:
    """Every command of the README's sweep, in order, as written (on free ports): the scheduler as installed,
    without PYTHONPATH, two workers, a queued 2 × 2 grid run by `dvc queue start -j 2` with every experiment's
    seeds on that cluster, and `make compare` tables and plots them."""
    import matplotlib.image

    blocks = _readme_dask_blocks()
    sweep = next(block for block in blocks if any(line.startswith("dvc exp run --queue") for line in block))
    assert sweep[0] == "source .venv/bin/activate" and sweep[-1] == "make compare"
    assert sweep[1].startswith("dask scheduler") and not [line for line in sweep if "PYTHONPATH" in line]
    shell = readme_shell(pipeline_copy)
    before = {run.info.run_id for run in _parents(pipeline_copy)}
    try:
        for command in sweep:
            if command.startswith("dvc queue status"):
                def finished(command: str = command) -> bool:
                    status = shell.run(command)
                    assert status is not None
                    return "Queued" not in status.stdout and "Running" not in status.stdout

                assert _poll(finished, 3 * STAGE_S, 2.0)
                status = shell.run(command)
                assert status is not None and status.stdout.count("Success") == 4, status.stdout
                continue
            if command.startswith("export "):
                shell.run(command)
                shell.wait_for_workers(2)  # the README's `&` lines have started them; the stages need them
                continue
            shell.run(command)
    finally:
        with contextlib.suppress(Exception):
            pipeline_copy.run("bash", "-c", "source .venv/bin/activate && dvc queue stop --kill", check=False)
    assert shell.env["DASK_SCHEDULER_ADDRESS"] == shell.address
    fresh = [run for run in _parents(pipeline_copy) if run.info.run_id not in before]
    # The committed combination (8 heads, dropout 0.6) has nothing to rerun: three new parent runs.
    grid = sorted((run.data.params["reproduce.protocol.cora.model.heads"],
                   run.data.params["reproduce.protocol.cora.model.dropout"]) for run in fresh)
    assert grid == [("4", "0.4"), ("4", "0.6"), ("8", "0.4")]
    for parent in fresh:
        assert parent.info.status == "FINISHED" and parent.data.tags["dask_scheduler"] == shell.address
        assert parent.data.tags["dvc_exp_name"]
        children = _children(pipeline_copy, parent.info.run_id)
        assert sorted(int(run.data.tags["seed"]) for run in children) == [0, 1, 2]
        assert {run.data.tags["worker_address"].rsplit(":", 1)[0] for run in children} == {"tcp://127.0.0.1"}
    table = (pipeline_copy.root / "reports/compare.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| cora |")]
    assert len(rows) == 4, table  # the three new configurations and the committed one
    for parent in fresh:
        assert any(parent.info.run_id in row and parent.data.tags["dvc_exp_name"] in row for row in rows)
    means = [float(row.split("|")[4].split("±")[0]) for row in rows]
    assert means == sorted(means, reverse=True)  # best first
    image = matplotlib.image.imread(pipeline_copy.root / "reports/compare.png")
    assert image.shape[0] > 200 and image.shape[1] > 300 and image.std() > 0.05
    (logged,) = pipeline_copy.runs(COMPARE_EXPERIMENT)
    assert logged.info.status == "FINISHED"


def test_the_readme_multi_host_commands_are_the_tls_recipes() -> None:
    """The multi-host block of the Dask section is the "Across hosts" recipe's scheduler, worker and address (which
    tests/test_multihost.py runs on six hosts), and both differ from the sweep's loopback commands only by TLS and the
    host names: the scheduler and each worker as installed, without PYTHONPATH, each worker with `--nthreads 1`."""
    blocks = _readme_dask_blocks()
    (multi_host,) = [block for block in blocks if any("tls://scheduler.example.org:8786" in line for line in block)]
    across = [line for block in readme_blocks("## Team mode: one MLflow server, one object store, shared experiments")
              for line in block]
    for line in multi_host:
        if "dask " in line or line.startswith("export DASK_SCHEDULER_ADDRESS"):
            assert line in across, line
    (scheduler,) = [line for line in multi_host if "dask scheduler" in line]
    (worker,) = [line for line in multi_host if "dask worker" in line]
    assert scheduler.startswith(".venv/bin/dask scheduler --host scheduler.example.org ")
    assert "--protocol tls" in scheduler
    assert worker.startswith(".venv/bin/dask worker tls://scheduler.example.org:8786 ") and "--nthreads 1" in worker
    assert not [line for block in blocks for line in block if "PYTHONPATH" in line or "0.0.0.0" in line]


def _without_the_project(folder: Path) -> Path:
    """The python of a virtual environment at `folder` that has every package of the venv but not the project:
    a worker's environment where nobody ran `make` (the venv's site-packages as a plain path, so its editable
    install's finder is not set up). Its scheduler and workers run from `folder`, no checkout."""
    import sys

    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(folder)],
                   check=True, capture_output=True, timeout=START_S)
    (site,) = (folder / "lib").glob("python3*/site-packages")
    (site / "venv-packages.pth").write_text("".join(f"{path}\n" for path in sys.path if path.endswith("site-packages")))
    python = folder / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import dask, torch, distributed; import stages"], cwd=folder,
                           env=clean_env(), capture_output=True, text=True, timeout=START_S)
    assert "No module named 'stages'" in probe.stderr, probe.stderr
    return python


def test_workers_that_cannot_run_the_task_are_one_line_errors(copy: Pipeline, tmp_path: Path,
                                                              readme_shell: Callable[[Pipeline], DaskShell]
                                                              ) -> None:
    """Workers of an environment where the project is not installed (they can't import the task), then, on the
    README's scheduler, a worker whose fused kernel is off (it would train with the torch kernel). Each is a
    one-line error naming the worker, exit 2, the MLflow run FAILED, nothing written. A scheduler that cannot read
    a task (here: one of that environment, sent the project's own objects, not bytes) is one too."""
    from stages.support.dask_pool import DaskPool
    from stages.support.params import StageError

    _reset(copy, **{"reproduce.executor": "dask"})

    def refused(out: Path, address: str) -> str:
        before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
        done = _reproduce(copy, out, address=address, check=False)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("error: ") and "Traceback" not in done.stderr, done.stderr
        assert [text for text in done.stderr.splitlines() if text.startswith("error: ")] == [line]
        fresh = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
        assert [run.info.status for run in fresh] == ["FAILED"]
        assert not out.exists()
        return line

    bare = _without_the_project(tmp_path / "bare-venv")
    folder = tmp_path / "bare-cluster"
    folder.mkdir()
    with _cluster(folder, ("worker-a", "worker-b"), python=bare) as cluster:
        line = refused(tmp_path / "not-installed", cluster.address)
        assert "the Dask worker tcp://127.0.0.1:" in line and f"of the scheduler at {cluster.address}" in line, line
        assert "No module named 'stages'" in line and "source .venv/bin/activate && dask worker" in line, line

        # The scheduler unpickles what it is sent: the project's objects, not bytes, it cannot read.
        with pytest.MonkeyPatch.context() as patch, \
                distributed.Client(cluster.address, timeout=START_S, set_as_default=False) as client:
            patch.setattr("stages.support.dask_pool.cloudpickled", lambda value: value)
            pool = DaskPool(client, None, cluster.address)
            with pytest.raises(StageError, match=f"the Dask scheduler at {cluster.address} cannot read the stage's "
                                                 r"tasks \(ModuleNotFoundError: No module named 'stages'\)"):
                list(pool.as_completed(os.getpid, {}, [()]))
            pool.cancel()

    sweep = next(block for block in _readme_dask_blocks() if any("dask scheduler" in line for line in block))
    (scheduler,) = [line for line in sweep if line.startswith("dask scheduler")]
    (worker,) = [line for line in sweep if "dask worker" in line]
    shell = readme_shell(copy)
    shell.run("source .venv/bin/activate")
    shell.run(scheduler)
    shell.run(worker, env={"GAT_FUSED_DISABLE": "1"})
    shell.wait_for_workers(2)
    line = refused(tmp_path / "torch-kernel", shell.address)
    assert "the worker tcp://127.0.0.1:" in line and "trained with torch (fused unavailable: GAT_FUSED_DISABLE" \
        in line and "but this stage trains with fused" in line, line


def test_a_worker_of_another_checkout_is_refused_before_any_seed_trains(copy: Pipeline, tmp_path: Path) -> None:
    """A Dask worker started in another checkout, whose gat/ differs from the stage's by one comment line, would train
    other code. The stage asks every worker for its code's digest before the first batch: a one-line error naming
    that worker, exit 2, the parent run FAILED with no child run, nothing written."""
    other = tmp_path / "other-checkout"
    for package in ("gat", "stages"):
        shutil.copytree(REPO / package, other / package, ignore=shutil.ignore_patterns("__pycache__"))
    edited = other / "gat" / "seeds.py"
    edited.write_text(edited.read_text() + "# a line this checkout has and the stage's does not\n")
    _reset(copy, **{"reproduce.executor": "dask"})
    before = {run.info.run_id for run in _parents(copy)}
    # Started in `other`, the worker imports gat and stages from there (`python -m` puts its folder first on sys.path).
    with _cluster(other, ("worker-a",)) as cluster:
        done = _reproduce(copy, tmp_path / "out", address=cluster.address, check=False)
        with cluster.client() as client:
            (worker,) = cluster.worker_pids(client)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [text for text in done.stderr.splitlines() if text.startswith("error: ")]
    assert line == done.stderr.strip().splitlines()[-1]
    assert f"the worker(s) {worker} ran other code than this stage started with" in line, line
    (parent,) = [run for run in _parents(copy) if run.info.run_id not in before]
    assert parent.info.status == "FAILED" and not _children(copy, parent.info.run_id)
    assert not (tmp_path / "out").exists()


def test_a_fallback_every_process_shares_is_said_and_tagged_not_refused(copy: Pipeline, tmp_path: Path) -> None:
    """No mix: where the stage and its local workers all lack the fused kernel, they all train with the torch kernel
    (one result of one kernel), each says so in one line naming why, and the parent run's tag shows the kernel."""
    _reset(copy)
    before = {run.info.run_id for run in _parents(copy)}
    done = _reproduce(copy, tmp_path / "out", address=None, extra_env={"GAT_FUSED_DISABLE": "1"})
    said = [line for line in done.stderr.splitlines() if "FusedFallbackWarning" in line]
    assert said and all("GAT_FUSED_DISABLE is set" in line for line in said), done.stderr
    assert "error:" not in done.stderr and (tmp_path / "out/seeds.csv").is_file()
    (parent,) = [run for run in _parents(copy) if run.info.run_id not in before]
    assert parent.data.tags["training_kernels"] == "torch (fused unavailable: GAT_FUSED_DISABLE is set)"
