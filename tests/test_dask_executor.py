"""`reproduce.executor: dask`: seed batches on a real Dask cluster give the local executor's results, byte for byte.

A module fixture (`dask_cluster`) starts `dask scheduler` and two `dask worker --nthreads 1` processes on
127.0.0.1, dashboards off, as the README's multi-host recipe does, and stops them, with every process they
started, at the end. Against it, with tiny params, in private copies of the session's pipeline
(tests/pipeline_support.py): a byte-identical seeds.csv, a worker SIGKILLed mid-run, SIGTERM to the stage,
and a two-experiment queued `dvc exp` sweep through the cluster, then `stages.compare`. Without it: an
unreachable scheduler, and the LocalCluster the stage starts when no scheduler is named (its results, and
Ctrl-C).

Every wait is a poll with a deadline; no test asserts a duration.
"""

from __future__ import annotations

import json
import os
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

from pipeline_support import TINY, VENV_BIN, Pipeline, clean_env
from stages._tracking import COMPARE_EXPERIMENT, REPRODUCE_EXPERIMENT

START_S = 120.0  # how long a scheduler, a worker or a stage may take to start on a busy 2-core machine
STAGE_S = 300.0  # how long a tiny stage may take, start to end
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


def _tree(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def _stop(processes: list[psutil.Process], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL what is left after `timeout`; returns once all are gone."""
    for process in processes:
        with _quiet():
            process.terminate()
    _gone, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        with _quiet():
            process.kill()
    psutil.wait_procs(alive, timeout=timeout)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> bool:
        return kind is not None and issubclass(kind, psutil.Error)


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


@pytest.fixture(scope="module")
def dask_cluster(pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskCluster]:
    folder = tmp_path_factory.mktemp("dask")
    # The workers import the task (stages._seeds) from the checkout the stages run from, as the README's
    # multi-host recipe says: the session pipeline's copy, which every copy of it shares.
    env = clean_env() | {"PYTHONPATH": str(pipeline.root)}
    started: list[subprocess.Popen] = []
    try:
        scheduler_file = folder / "scheduler.json"
        started.append(subprocess.Popen(
            [str(VENV_BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)],
            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=_log(folder, "scheduler")))
        assert _poll(lambda: scheduler_file.is_file() and scheduler_file.stat().st_size > 0, START_S), \
            (folder / "scheduler.log").read_text()
        time.sleep(0.2)  # the file is written in one go, but let it be closed
        address = json.loads(scheduler_file.read_text())["address"]
        for name in ("worker-a", "worker-b"):
            started.append(subprocess.Popen(
                [str(VENV_BIN / "dask"), "worker", address, "--nthreads", "1", "--nworkers", "1", "--no-dashboard",
                 "--dashboard-address", "127.0.0.1:0", "--host", "127.0.0.1", "--name", name,
                 "--local-directory", str(folder / name)],
                cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=_log(folder, name)))
        cluster = DaskCluster(address, folder, started)
        cluster.wait_for_workers(2)
        yield cluster
    finally:
        everything = [process for popen in started for process in _tree(popen.pid)]
        _stop(everything)
        assert not [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def copy(pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    """One private copy of the session's pipeline for this module's direct stage runs (the sweep has its own)."""
    return pipeline.copy_to(tmp_path_factory.mktemp("dask-copy") / "gat-repro")


def _reproduce(pipeline: Pipeline, out: Path, *, address: str | None, check: bool = True,
               **params: object) -> subprocess.CompletedProcess:
    """`python -m stages.reproduce` for cora in `pipeline` with `params`, on the cluster at `address`."""
    pipeline.set_params(**params)
    env = {k: v for k, v in pipeline.env.items() if k != "DASK_SCHEDULER_ADDRESS"}
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

def test_external_workers_write_the_local_seeds_csv_byte_for_byte(copy: Pipeline, dask_cluster: DaskCluster,
                                                                  tmp_path: Path) -> None:
    """The session's `dvc repro` ran the local executor (2 processes, 2 seeds per batch); here one seed per task on
    the cluster's two workers. Each child run records where its seed ran."""
    dask_cluster.wait_for_workers(2)
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
            with _quiet():
                if process.cwd() == str(copy.root) and process.pid != os.getpid():
                    found.append(process)
        return found

    assert _poll(lambda: not left_behind(), 10), [p.cmdline() for p in left_behind()]


def test_the_local_cluster_settings_yield_to_the_users() -> None:
    """Where the user set one of LOCAL_CLUSTER_CONFIG's keys, the stage's LocalCluster keeps the user's value."""
    import dask

    from stages._dask import LOCAL_CLUSTER_CONFIG, local_cluster_config

    assert local_cluster_config() == LOCAL_CLUSTER_CONFIG  # Dask's defaults here: the stage's values apply
    with dask.config.set({"distributed.admin.tick.interval": "50ms", "distributed.worker.profile.enabled": False}):
        kept = local_cluster_config()
    assert "distributed.admin.tick.interval" not in kept
    assert kept["distributed.worker.memory.monitor-interval"] == "500ms"


def test_a_local_cluster_starts_in_the_background_and_never_outlives_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """starting_dask_pool: the workers run with the stage's settings; an error before the pool is asked for
    still closes the cluster started for it, and a normal end too, leaving no process behind."""
    import dask

    from stages._dask import starting_dask_pool

    monkeypatch.setenv("GAT_DASK_DASHBOARD", "off")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    me = psutil.Process()
    others = set(me.children(recursive=True))

    def ours() -> list[psutil.Process]:  # multiprocessing's resource tracker lives as long as this process: not ours
        found = []
        for process in me.children(recursive=True):
            with _quiet():
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


def test_ctrl_c_stops_a_local_cluster_and_its_workers(copy: Pipeline, tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group, the LocalCluster's workers included: one message, the run FAILED,
    no process left."""
    _reset(copy, **FOREVER, **{"reproduce.executor": "dask", "reproduce.workers": 1})
    before = {run.info.run_id for run in copy.runs(REPRODUCE_EXPERIMENT)}
    err = tmp_path / "stderr.txt"
    # Ctrl-C's default action, as in a terminal, even when the test runner itself runs as a background job.
    with err.open("w") as stderr:
        stage = subprocess.Popen(
            [str(VENV_BIN / "python"), "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.argv[1], sys.argv[1:])", *_reproduce_command(tmp_path / "out")],
            cwd=copy.root, env={**copy.env, "GAT_DASK_DASHBOARD": "off"}, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True)
    processes: list[psutil.Process] = []
    try:
        def training() -> bool:  # the worker process is busy: its CPU time grows
            tree = _tree(stage.pid)
            processes.extend(p for p in tree if p not in processes)
            return "LocalCluster" in err.read_text() and any(
                p.cpu_times().user > 5 for p in tree[1:] if "spawn_main" in " ".join(p.cmdline()))

        assert _poll(lambda: stage.poll() is not None or training(), START_S, 0.5), err.read_text()
        os.killpg(stage.pid, signal.SIGINT)
        assert stage.wait(timeout=60) == 128 + signal.SIGINT
        assert _poll(lambda: not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
                     10), "a process of the stage's cluster outlived it"
    finally:
        _stop([p for p in [*processes, *_tree(stage.pid)] if p.is_running()], timeout=1)
    lines = err.read_text().strip().splitlines()
    assert lines[-1] == ("error: interrupted by SIGINT: stopping; the MLflow run is marked FAILED and no output is "
                         "written."), err.read_text()
    assert len(lines) == 2 and "Traceback" not in err.read_text()  # the cluster line, then the stop
    fresh = [run for run in copy.runs(REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    assert [run.info.status for run in fresh] == ["FAILED"]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------- sweeps

def test_a_queued_sweep_runs_through_the_cluster_and_compare_shows_it(pipeline_copy: Pipeline,
                                                                      dask_cluster: DaskCluster,
                                                                      tmp_path: Path) -> None:
    """The README's ablation: a two-value grid queued with `dvc exp run --queue -S`, run by `dvc queue start -j 2`
    with every experiment's seeds on the same cluster; `stages.compare` then tables and plots both."""
    import matplotlib.image

    dask_cluster.wait_for_workers(2)
    pipeline_copy.set_params(**{"reproduce.executor": "dask"})
    pipeline_copy.commit("reproduce on the Dask cluster")
    pipeline_copy.env["DASK_SCHEDULER_ADDRESS"] = dask_cluster.address
    before = {run.info.run_id for run in pipeline_copy.runs(REPRODUCE_EXPERIMENT)}
    queued = pipeline_copy.dvc("exp", "run", "--queue", "-S", "reproduce.protocol.cora.model.heads=2,4")
    assert queued.stdout.count("Queueing with overrides") == 2, queued.stdout
    try:
        pipeline_copy.dvc("queue", "start", "-j", "2")

        def finished() -> bool:
            status = pipeline_copy.dvc("queue", "status").stdout
            return "Queued" not in status and "Running" not in status

        assert _poll(finished, 2 * STAGE_S, 2.0), pipeline_copy.dvc("queue", "status").stdout
    finally:
        pipeline_copy.dvc("queue", "stop", "--kill", check=False)
    status = pipeline_copy.dvc("queue", "status").stdout
    assert status.count("Success") == 2, status
    fresh = [run for run in _parents(pipeline_copy) if run.info.run_id not in before]
    assert sorted(run.data.params["reproduce.protocol.cora.model.heads"] for run in fresh) == ["2", "4"]
    names = sorted(run.data.tags["dvc_exp_name"] for run in fresh)
    for parent in fresh:
        assert parent.info.status == "FINISHED" and parent.data.tags["dask_scheduler"] == dask_cluster.address
        children = _children(pipeline_copy, parent.info.run_id)
        assert sorted(int(run.data.tags["seed"]) for run in children) == [0, 1, 2]
        assert {run.info.status for run in children} == {"FINISHED"}

    done = pipeline_copy.python("-m", "stages.compare", *(f"--exp={name}" for name in names),
                                "--markdown", str(tmp_path / "compare.md"), "--plot", str(tmp_path / "compare.png"))
    table = (tmp_path / "compare.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| cora |")]
    assert len(rows) == 2 and {"model.heads=2" in rows[0] or "model.heads=2" in rows[1],
                               "model.heads=4" in rows[0] or "model.heads=4" in rows[1]} == {True}
    for parent in fresh:
        assert any(parent.info.run_id in row and parent.data.tags["dvc_exp_name"] in row for row in rows)
    means = [float(row.split("|")[4].split("±")[0]) for row in rows]
    assert means == sorted(means, reverse=True)  # best first
    image = matplotlib.image.imread(tmp_path / "compare.png")
    assert image.shape[0] > 200 and image.shape[1] > 300 and image.std() > 0.05
    (logged,) = pipeline_copy.runs(COMPARE_EXPERIMENT)
    assert logged.info.status == "FINISHED" and logged.data.metrics["configurations"] == 2
    artifacts = {item.path for item in pipeline_copy.client.list_artifacts(logged.info.run_id)}
    assert {"compare.md", "compare.png", "compare.json"} <= artifacts
    assert "2 configurations" in done.stdout
