"""Interrupts and dead parents: a stage stops within seconds, leaves no process behind, no MLflow run
RUNNING and no output.

The first tests drive small scripts that use stages.support.interrupts.main and stages.support.local_pool.worker_pool
directly (seconds each); the last ones interrupt the real stages in a private copy of the pipeline
(tests/pipeline_support.py). Every wait is a poll with a deadline; every process a test starts is
killed in a `finally`, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil
import pytest
from conftest import WITH_DEFAULT_SIGNALS
from pipeline_support import VENV_BIN, Pipeline

from stages.support.store import REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT

REPO = Path(__file__).resolve().parents[1]
# What a started worker calls itself (stages.support.local_pool.WORKER_NAME; not imported, so that this module loads
# without it).
WORKER_NAME = "gat-worker"
# How long an interrupted stage may take to exit: its handlers act within a second, then the MLflow run
# is closed and the interpreter (torch, MLflow) shuts down, about 2 s on a busy 2-core machine.
STOP_S = 15.0
# How long the workers of a killed process may outlive it: PR_SET_PDEATHSIG acts at once.
REAP_S = 5.0
# How long a stage may take to start (imports, the MLflow store, spawned workers) on a busy machine.
START_S = 120.0

# A stand-in for a stage: `main()` around a worker pool whose jobs sleep `seconds` each (the arguments),
# print "started <pid>" when they start and fail on a negative number; the results print in order.
POOL_STAGE = '''
import os, sys, time
from stages.support.interrupts import main
from stages.support.local_pool import worker_pool

def job(seconds):
    # One write per line: both workers share the stage's stdout, and with PYTHONUNBUFFERED (as in CI) print
    # writes the text and its newline apart, so two workers' lines could run together.
    os.write(1, f"started {os.getpid()}\\n".encode())
    if seconds < 0:
        raise ValueError("a failed batch")
    time.sleep(seconds)
    return seconds

def run():
    with worker_pool(2) as pool:
        for seconds in pool.map(job, [float(s) for s in sys.argv[1:]]):
            print(f"done {seconds}", flush=True)

if __name__ == "__main__":
    main(run)
'''

# A stage that notes each import of its main module (by the stage itself, and by a spawned worker, where it is
# __mp_main__) and runs two jobs: its own function ("main", argv[1]), or one from another module (time.sleep).
MAIN_IMPORT_STAGE = '''
import os, sys, time
with open("imported.txt", "a") as noted:
    noted.write(f"{os.getpid()}\\n")
from stages.support.local_pool import worker_pool

def job(seconds):
    time.sleep(seconds)

if __name__ == "__main__":
    function = job if sys.argv[1] == "main" else time.sleep
    with worker_pool(2) as pool:
        done = list(pool.map(function, [0.2, 0.2]))
    print(f"parent {os.getpid()}: {len(done)} jobs", flush=True)
'''

# A handover of a file descriptor (how a job's tensors reach a worker) to a worker killed before it took it:
# multiprocessing's resource_sharer thread finds the connection closed. With "killed" (argv[1]), the pool has killed
# its workers first (a stop, a failed job), as it was when Ctrl-C came during reproduce's first batches.
DEAD_HANDOVER_STAGE = '''
import os, socket, sys, time
from multiprocessing import resource_sharer
from stages.support.local_pool import worker_pool

try:
    with worker_pool(1):
        if sys.argv[1] == "killed":
            raise RuntimeError("stop")
except RuntimeError:
    pass
readable, _ = os.pipe()
handover = resource_sharer.DupFd(readable)
peer = socket.socket(socket.AF_UNIX)
peer.connect(resource_sharer._resource_sharer._address)
peer.close()
time.sleep(1.0)
print("done", flush=True)
'''

# A stand-in for a stage that starts its workers before any job (WorkerPool.start), each preloading the module
# `imported_by_workers` (written beside it: it notes the importing process, and its interpreter's teardown), then
# runs three jobs on them.
STARTED_POOL_STAGE = '''
import json, time
from pathlib import Path
from stages.support.interrupts import main
from stages.support.local_pool import worker_pool

def run():
    with worker_pool(2, preload=["imported_by_workers"]) as pool:
        pool.start()
        deadline = time.monotonic() + 30
        while len(list(Path().glob("imported-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        importers = sorted(int(path.name.split("-")[1]) for path in Path().glob("imported-*"))
        workers = sorted(p.pid for p in pool.workers())
        print("before any job: " + json.dumps({"imported by": importers, "workers": workers}), flush=True)
        print(f"results {list(pool.map(abs, [-1, -2, -3]))}", flush=True)

if __name__ == "__main__":
    main(run)
'''

IMPORTED_BY_WORKERS = '''
import atexit, os
open(f"imported-{os.getpid()}", "w").close()
atexit.register(lambda: open(f"torn-down-{os.getpid()}", "w").close())
'''

# A stand-in for a stage whose MLflow run fails to open inside stages.support.seed_pool.starting_pool's block: how
# many worker processes run meanwhile, and after the block.
FAILED_SETUP_STAGE = '''
import multiprocessing, sys
import torch
from stages.support.interrupts import main
from stages.support.seed_pool import starting_pool

def run():
    try:
        with starting_pool("local", 2, torch.device("cpu"), start_now=sys.argv[1] == "now"):
            print(f"while the run opens: {len(multiprocessing.active_children())} workers", flush=True)
            raise RuntimeError("the MLflow run failed to open")
    except RuntimeError:
        print(f"after the block: {len(multiprocessing.active_children())} workers", flush=True)

if __name__ == "__main__":
    main(run)
'''

# A stand-in for a stage that works forever inside an atomic output folder.
ENDLESS_STAGE = '''
import sys, time
from stages.support.files import atomic_dir
from stages.support.interrupts import main

def run():
    with atomic_dir(sys.argv[1]) as staging:
        (staging / "partial.txt").write_text("half")
        print("running", flush=True)
        while True:
            time.sleep(0.05)

if __name__ == "__main__":
    main(run)
'''

# A stand-in for a stage whose SIGTERM arrives while a finalizer runs, where an exception raised by the signal
# handler is printed as "Exception ignored" and dropped (as one was, in a SQLAlchemy weakref callback, when
# dvc died right after the train stage had started its run). The signal comes once the file `trigger`
# exists, from inside the finalizer, so that it is handled there every time.
FINALIZING_STAGE = '''
import os, signal, time
from pathlib import Path
from stages.support.interrupts import main

class Finalized:
    def __del__(self):
        if Path("trigger").exists():
            Path("trigger").unlink()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)

def run():
    print("running", flush=True)
    while True:
        Finalized()
        time.sleep(0.005)

if __name__ == "__main__":
    main(run)
'''

# A stand-in for a stage whose interpreter shutdown never ends: a thread that is not a daemon, which Python joins
# before the atexit handlers (the real stages' shutdown is slow, not endless: torch's, MLflow's and SQLAlchemy's
# modules take about 2 s of CPU to tear down, 10 s and more on a busy machine).
ENDLESS_SHUTDOWN_STAGE = '''
import threading, time
from stages.support.interrupts import main

def run():
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    print("running", flush=True)
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    main(run)
'''

# A stage that is done: its thread must be waited for, its atexit handler run and its last, unflushed words
# printed; an object that the interpreter's teardown would delete says so, and must not get the chance.
DONE_STAGE = '''
import atexit, threading, time
from stages.support.interrupts import main

class Module:
    def __del__(self):
        print("torn down", flush=True)

HELD = Module()

def run():
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done")), daemon=False).start()
    atexit.register(print, "atexit handler")
    print("done", end="")

if __name__ == "__main__":
    main(run)
'''


# ---------------------------------------------------------------------------------------------- helpers

def _poll(condition: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    """Whether `condition()` became true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (a dead orphan waits for init to reap it)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    return [process for process in processes if _running(process)]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _workers(pid: int) -> list[psutil.Process]:
    """The pool workers among a process's descendants (not multiprocessing's resource tracker)."""
    found = []
    for process in _descendants(pid):
        try:
            if "spawn_main" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def _armed(process: psutil.Process) -> bool:
    """Whether a worker has started, i.e. armed to die with its parent (it then renames itself)."""
    try:
        return process.name() == WORKER_NAME
    except psutil.Error:
        return False


def _kill(processes: Iterable[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass


def _dump_stacks(processes: Iterable[psutil.Process]) -> list[str]:
    """The command lines of the processes still running; the Python ones among them (started with
    PYTHONFAULTHANDLER=1) are sent SIGABRT, so that each writes every thread's stack to its stderr."""
    stuck = _alive(processes)
    described = []
    for process in stuck:
        try:
            described.append(f"pid {process.pid} ({process.status()}): {' '.join(process.cmdline())}")
            if "python" in process.name() or "python" in " ".join(process.cmdline()[:1]):
                process.send_signal(signal.SIGABRT)
        except psutil.Error:
            pass
    _poll(lambda: not _alive(stuck), REAP_S)
    return described


def _start(script: str, tmp_path: Path, *args: str, **popen: object) -> tuple[subprocess.Popen, Path, Path]:
    """Run `script` with stdout and stderr to files (a pipe nobody reads could block it), and with
    PYTHONFAULTHANDLER, so that _dump_stacks can make it (and its workers) show where they are."""
    path = tmp_path / "stage.py"
    path.write_text(script)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen([*WITH_DEFAULT_SIGNALS, sys.executable, str(path), *args], cwd=tmp_path, env=env,
                                   stdout=stdout, stderr=stderr, **popen)  # type: ignore[call-overload]
    return process, out, err


def _lines(path: Path, prefix: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith(prefix)]


def _wait_started(process: subprocess.Popen, out: Path, err: Path, jobs: int = 2) -> None:
    """Wait until `jobs` jobs of POOL_STAGE have printed "started"; else fail with what the stage and its
    workers were doing (each one's stack, from faulthandler) and everything they wrote on stderr."""
    if _poll(lambda: len(_lines(out, "started")) >= jobs or process.poll() is not None, START_S):
        if len(_lines(out, "started")) == jobs:
            return
    tree = [] if process.poll() is not None else [psutil.Process(process.pid), *_descendants(process.pid)]
    stuck = _dump_stacks(tree)
    pytest.fail(f"{len(_lines(out, 'started'))} of {jobs} jobs started in {START_S:.0f} s; the stage "
                f"{'exited ' + str(process.poll()) if not tree else 'and its children: ' + repr(stuck)}\n"
                f"stdout:\n{out.read_text()[-2000:]}\nstderr:\n{err.read_text()[-12000:]}")


class Cleanup:
    """Every process a test starts, and all their descendants seen so far, killed at the end."""

    def __init__(self) -> None:
        self.seen: dict[int, psutil.Process] = {}

    def watch(self, pid: int) -> None:
        try:
            found = [psutil.Process(pid), *_descendants(pid)]
        except psutil.Error:
            return
        for process in found:
            self.seen.setdefault(process.pid, process)

    def kill_all(self) -> None:
        _kill(self.seen.values())


@pytest.fixture
def cleanup() -> Iterable[Cleanup]:
    tracked = Cleanup()
    try:
        yield tracked
    finally:
        tracked.kill_all()


# ------------------------------------------------------------------------------------- worker pool level

def _run_to_exit(script: str, tmp_path: Path, cleanup: Cleanup, *args: str,
                 exit_code: int = 0) -> tuple[subprocess.Popen, Path]:
    """Run `script` until it exits, which must be with `exit_code`; the process and its stdout file (its stderr is
    tmp_path / "stderr.txt")."""
    process, out, err = _start(script, tmp_path, *args)
    try:
        cleanup.watch(process.pid)
        assert process.wait(timeout=START_S) == exit_code, err.read_text()
    finally:
        process.kill()
    return process, out


def test_results_come_in_order_and_the_pool_leaves_no_process(tmp_path: Path, cleanup: Cleanup) -> None:
    process, out = _run_to_exit(POOL_STAGE, tmp_path, cleanup, "0.6", "0.1", "0.3", "0")
    assert _lines(out, "done") == ["done 0.6", "done 0.1", "done 0.3", "done 0.0"]
    assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S)


def test_started_workers_import_the_jobs_modules_before_any_job(tmp_path: Path, cleanup: Cleanup) -> None:
    """WorkerPool.start: both workers run, and have imported the pool's preload module, before the first job is
    submitted; the jobs then run on them, in order."""
    (tmp_path / "imported_by_workers.py").write_text(IMPORTED_BY_WORKERS)
    process, out = _run_to_exit(STARTED_POOL_STAGE, tmp_path, cleanup)
    [before] = _lines(out, "before any job")
    found = json.loads(before.removeprefix("before any job: "))
    assert len(found["workers"]) == 2 and found["imported by"] == found["workers"], before
    assert _lines(out, "results") == ["results [1, 2, 3]"]
    assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S)


def test_a_preload_that_fails_to_import_is_one_line_naming_the_module(tmp_path: Path, cleanup: Cleanup) -> None:
    """A worker whose preload module raises on import: the first job says which module and why, in one line (exit
    2), where the broken pool used to say that a worker had died; no traceback, no process left."""
    (tmp_path / "imported_by_workers.py").write_text('raise ImportError("built for another Python")\n')
    stage = STARTED_POOL_STAGE.replace("deadline = time.monotonic() + 30", "deadline = time.monotonic()")  # no wait
    _, out = _run_to_exit(stage, tmp_path, cleanup, exit_code=2)
    assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S)
    assert (tmp_path / "stderr.txt").read_text() == ("error: a worker process could not import imported_by_workers "
                                                     "(ImportError: built for another Python): fix it, then rerun "
                                                     "the stage\n")
    assert _lines(out, "results") == []


def test_a_pool_whose_jobs_are_done_kills_its_idle_workers(tmp_path: Path, cleanup: Cleanup) -> None:
    """WorkerPool.close with every job done: the idle workers are killed, not left to run the interpreter's teardown
    (an atexit handler of theirs never runs), which the stage would wait for."""
    (tmp_path / "imported_by_workers.py").write_text(IMPORTED_BY_WORKERS)
    _run_to_exit(STARTED_POOL_STAGE, tmp_path, cleanup)
    assert len(list(tmp_path.glob("imported-*"))) == 2
    assert list(tmp_path.glob("torn-down-*")) == []


@pytest.mark.parametrize("start", ["now", "later"])
def test_workers_started_with_the_stages_set_up_die_when_it_fails(tmp_path: Path, cleanup: Cleanup,
                                                                  start: str) -> None:
    """starting_pool starts the local workers as its block begins (start_now), so that they import torch while the
    stage opens its MLflow run; if that fails, they are killed at once. start_now=False (an ablation with
    nothing left to train) starts none."""
    process, out = _run_to_exit(FAILED_SETUP_STAGE, tmp_path, cleanup, start)
    assert _lines(out, "while") == [f"while the run opens: {2 if start == 'now' else 0} workers"]
    assert _lines(out, "after") == ["after the block: 0 workers"]


@pytest.mark.parametrize("job_in", ["main", "elsewhere"])
def test_workers_import_the_stages_main_module_only_for_its_own_jobs(tmp_path: Path, cleanup: Cleanup,
                                                                    job_in: str) -> None:
    # `python -m stages.reproduce` imports MLflow and matplotlib; its jobs live in stages.support.seed_task.
    process, out = _run_to_exit(MAIN_IMPORT_STAGE, tmp_path, cleanup, job_in)
    assert _lines(out, "parent") == [f"parent {process.pid}: 2 jobs"]
    importers = (tmp_path / "imported.txt").read_text().split()
    assert importers[0] == str(process.pid)
    assert len(importers) == (3 if job_in == "main" else 1)  # the two workers, or no one but the stage


@pytest.mark.parametrize("pool_end", ["killed", "closed"])
def test_a_handover_to_a_killed_worker_prints_no_traceback(tmp_path: Path, cleanup: Cleanup, pool_end: str) -> None:
    """Once the pool has killed its workers, the resource_sharer's reset connection is expected and not shown;
    before that (a pool closed normally), it is a real fault and still printed."""
    process, out, err = _start(DEAD_HANDOVER_STAGE, tmp_path, pool_end)
    try:
        cleanup.watch(process.pid)
        assert process.wait(timeout=START_S) == 0, err.read_text()
    finally:
        process.kill()
    assert _lines(out, "done") == ["done"]
    assert ("Traceback" in err.read_text()) == (pool_end == "closed"), err.read_text()


# POOL_STAGE whose workers cannot arm PR_SET_PDEATHSIG (as where prctl is missing): an option prctl refuses, set at
# the top of the script, which each spawned worker runs again before its initializer.
NO_PDEATHSIG_STAGE = POOL_STAGE.replace("from stages.support.local_pool import worker_pool\n", """\
from stages.support import local_pool
from stages.support.local_pool import worker_pool
local_pool.PR_SET_PDEATHSIG = -1
""")


@pytest.mark.parametrize("armed", [True, False], ids=["pdeathsig", "polling"])
def test_workers_die_with_a_killed_parent(tmp_path: Path, cleanup: Cleanup, armed: bool) -> None:
    """Workers die with a SIGKILLed stage: through PR_SET_PDEATHSIG, or, where the kernel can't be asked, by polling
    their parent (stages.support.supervision, as the stage's watchdog does) within a poll of its death."""
    process, out, err = _start(POOL_STAGE if armed else NO_PDEATHSIG_STAGE, tmp_path, "600", "600", "600")
    try:
        cleanup.watch(process.pid)
        _wait_started(process, out, err)
        cleanup.watch(process.pid)
        workers = _workers(process.pid)
        assert len(workers) == 2 and all(_armed(worker) == armed for worker in workers)  # armed workers rename
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=STOP_S) == -signal.SIGKILL
        assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S), \
            f"orphaned: {[p.pid for p in _alive(cleanup.seen.values())]}"
    finally:
        process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_stops_running_jobs_at_once(tmp_path: Path, cleanup: Cleanup, signum: int) -> None:
    """Ctrl-C (SIGINT) and a closed terminal (SIGHUP, which the shell sends to its jobs) reach the whole
    process group: the workers get them too."""
    process, out, err = _start(POOL_STAGE, tmp_path, "600", "600", "600", start_new_session=True)
    try:
        cleanup.watch(process.pid)
        _wait_started(process, out, err)
        cleanup.watch(process.pid)
        os.killpg(process.pid, signum)
        assert process.wait(timeout=STOP_S) == 128 + signum
        assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S)
    finally:
        process.kill()
    name = signal.Signals(signum).name
    assert err.read_text().strip() == (f"error: interrupted by {name}: stopping; the MLflow run is marked FAILED "
                                       "and no output is written.")
    assert _lines(out, "done") == []


def test_a_killed_worker_is_one_line_and_stops_the_others(tmp_path: Path, cleanup: Cleanup) -> None:
    """A worker SIGKILLed (the OOM killer, say): the executor fails every job; the stage says so in one line."""
    process, out, err = _start(POOL_STAGE, tmp_path, "600", "600", "600")
    try:
        cleanup.watch(process.pid)
        _wait_started(process, out, err)
        cleanup.watch(process.pid)
        _workers(process.pid)[0].kill()
        assert process.wait(timeout=STOP_S) == 2, err.read_text()
        assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S)
    finally:
        process.kill()
    assert err.read_text() == ("error: a worker process died while it ran a job (killed, or out of memory: see "
                               "`dmesg`); the other workers are stopped: rerun the stage\n")


def test_a_failed_job_stops_the_others_at_once(tmp_path: Path, cleanup: Cleanup) -> None:
    process, out, err = _start(POOL_STAGE, tmp_path, "600", "-1", "600")
    try:
        assert _poll(lambda: process.poll() is not None or len(_workers(process.pid)) == 2, START_S)
        cleanup.watch(process.pid)
        assert process.wait(timeout=START_S) == 1
        assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S)
    finally:
        process.kill()
    assert "ValueError: a failed batch" in err.read_text()
    assert len(_lines(out, "started")) >= 2


@pytest.mark.parametrize("through_sh", [False, True], ids=["direct", "through-sh"])
def test_a_stage_stops_when_its_parent_dies(tmp_path: Path, cleanup: Cleanup, through_sh: bool) -> None:
    """The parent (dvc, here bash) killed outright: the orphaned stage notices and stops. Also when a shell
    that outlives it stands between them, as `/bin/sh -c` does when dvc runs a stage with no $SHELL set
    (dash does not exec the command; the trailing `:` makes sure of it)."""
    stage = tmp_path / "stage.py"
    stage.write_text(ENDLESS_STAGE)
    env = dict(os.environ)
    command = f"'{sys.executable}' '{stage}' '{tmp_path / 'out'}'"
    if through_sh:
        command = f'/bin/sh -c "{command}; :"'
    with (tmp_path / "stdout.txt").open("w") as stdout, (tmp_path / "stderr.txt").open("w") as stderr:
        shell = subprocess.Popen(["bash", "-c", f"{command} & wait"],
                                 cwd=tmp_path, env=env, stdout=stdout, stderr=stderr)
    try:
        assert _poll(lambda: bool(_lines(tmp_path / "stdout.txt", "running")) or shell.poll() is not None, START_S)
        cleanup.watch(shell.pid)
        (child,) = [process for process in _descendants(shell.pid) if str(stage) in process.cmdline()]
        assert (child.parent().name() == "sh") is through_sh
        shell.send_signal(signal.SIGKILL)
        shell.wait(timeout=STOP_S)
        started = time.monotonic()
        assert _poll(lambda: not _running(child), STOP_S), "the orphaned stage kept running"
        stopped_in = time.monotonic() - started
    finally:
        shell.kill()
    stderr_text = (tmp_path / "stderr.txt").read_text().strip()
    assert stderr_text == (f"error: the parent process (bash, pid {shell.pid}) is gone: stopping; the MLflow run "
                           "is marked FAILED and no output is written."), stderr_text
    assert stopped_in < STOP_S
    assert sorted(path.name for path in tmp_path.iterdir()) == ["stage.py", "stderr.txt", "stdout.txt"]


def test_a_stop_swallowed_by_a_finalizer_still_stops_the_stage(tmp_path: Path, cleanup: Cleanup) -> None:
    process, out, err = _start(FINALIZING_STAGE, tmp_path)
    try:
        assert _poll(lambda: bool(_lines(out, "running")) or process.poll() is not None, START_S)
        cleanup.watch(process.pid)
        (tmp_path / "trigger").touch()
        try:
            code = process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_S:.0f} s after SIGTERM:\n{err.read_text()[-2000:]}")
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM
    assert err.read_text().strip() == ("error: interrupted by SIGTERM: stopping; the MLflow run is marked FAILED "
                                       "and no output is written.")


def test_a_stopped_stage_exits_without_the_interpreter_teardown(tmp_path: Path, cleanup: Cleanup) -> None:
    """Once the stop is handled (the run ended, outputs discarded, workers killed), the stage exits at once, with
    the atexit handlers run but not the interpreter's shutdown: here, that would wait for the thread forever."""
    process, out, err = _start(ENDLESS_SHUTDOWN_STAGE, tmp_path)
    try:
        assert _poll(lambda: bool(_lines(out, "running")) or process.poll() is not None, START_S)
        cleanup.watch(process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_S:.0f} s after SIGTERM: {_dump_stacks([psutil.Process(process.pid)])}"
                        f"\n{err.read_text()[-4000:]}")
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM
    assert err.read_text().strip() == ("error: interrupted by SIGTERM: stopping; the MLflow run is marked FAILED "
                                       "and no output is written.")


def test_a_stage_that_is_done_exits_without_the_interpreter_teardown(tmp_path: Path, cleanup: Cleanup) -> None:
    """Done: the stage waits for its threads, runs its atexit handlers, prints what it buffered and exits 0, but
    skips the interpreter's teardown (1.2 to 1.5 s of every real stage's wall time)."""
    process, out = _run_to_exit(DONE_STAGE, tmp_path, cleanup)
    assert out.read_text().splitlines() == ["donethread done", "atexit handler"]


# ------------------------------------------------------------------------------------------- stage level

REPRODUCE_FOREVER = {"reproduce.seeds": 4, "reproduce.seeds_per_batch": 1, "reproduce.workers": 2,
                     "reproduce.protocol.cora.optim.max_epochs": 100000,
                     "reproduce.protocol.cora.optim.patience": 100000}


def _new_run(pipeline: Pipeline, experiment: str, before: set[str]):
    """The run of `experiment` that is not in `before`, or None."""
    fresh = [run for run in pipeline.runs(experiment) if run.info.run_id not in before]
    return fresh[0] if fresh else None


def _run_ids(pipeline: Pipeline, experiment: str) -> set[str]:
    return {run.info.run_id for run in pipeline.runs(experiment)}


def _start_reproduce(pipeline: Pipeline, tmp_path: Path, params: dict[str, object] = REPRODUCE_FOREVER,
                     **popen: object) -> tuple[subprocess.Popen, Path]:
    pipeline.set_params(**params)
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        process = subprocess.Popen(
            [*WITH_DEFAULT_SIGNALS, str(VENV_BIN / "python"), "-m", "stages.reproduce", "--dataset", "cora", "--data",
             "data/prepared/cora",
             "--out", str(tmp_path / "out")], cwd=pipeline.root, env=pipeline.env, stdout=subprocess.DEVNULL,
            stderr=stderr, **popen)  # type: ignore[call-overload]
    return process, err


def _wait_for_training(pipeline: Pipeline, process: subprocess.Popen, err: Path, before: set[str]):
    """The stage's RUNNING parent run, once both workers are training."""
    assert _poll(lambda: process.poll() is not None or (_new_run(pipeline, REPRODUCE_EXPERIMENT, before)
                                                         and len(_workers(process.pid)) == 2), START_S, 0.5), \
        f"reproduce never started its workers:\n{err.read_text()}"
    assert process.poll() is None, err.read_text()
    # Started workers have armed PR_SET_PDEATHSIG (and renamed themselves); wait for that, within bounds.
    _poll(lambda: all(_armed(worker) for worker in _workers(process.pid)), START_S / 2, 0.2)
    return _new_run(pipeline, REPRODUCE_EXPERIMENT, before)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_interrupted_reproduce_stops_within_seconds(pipeline_copy: Pipeline, tmp_path: Path, cleanup: Cleanup,
                                                    signum: int) -> None:
    """SIGTERM to the stage, or Ctrl-C or a closed terminal (SIGINT, SIGHUP to its whole process group), while
    batches train."""
    before = _run_ids(pipeline_copy, REPRODUCE_EXPERIMENT)
    process, err = _start_reproduce(pipeline_copy, tmp_path, start_new_session=True)
    try:
        run = _wait_for_training(pipeline_copy, process, err, before)
        cleanup.watch(process.pid)
        if signum != signal.SIGTERM:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        started = time.monotonic()
        try:
            code = process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"reproduce still running {STOP_S:.0f} s after {signal.Signals(signum).name}")
        stopped_in = time.monotonic() - started
        assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S), \
            f"left running: {[p.pid for p in _alive(cleanup.seen.values())]}"
    finally:
        process.kill()
    assert code == 128 + signum
    assert pipeline_copy.client.get_run(run.info.run_id).info.status == "FAILED"
    assert "RUNNING" not in {run.info.status for run in pipeline_copy.runs(REPRODUCE_EXPERIMENT)}
    assert not (tmp_path / "out").exists()
    assert f"interrupted by {signal.Signals(signum).name}" in err.read_text()
    assert "Traceback" not in err.read_text()
    print(f"reproduce stopped {stopped_in:.1f} s after {signal.Signals(signum).name}")


def test_a_stopped_reproduce_keeps_the_seeds_it_finished_as_child_runs(pipeline_copy: Pipeline, tmp_path: Path,
                                                                       cleanup: Cleanup) -> None:
    """Each batch's child runs are logged as the batch comes in, not after the last one: SIGTERM once the first seeds
    are in leaves them FINISHED under the FAILED parent, no child RUNNING, and no output."""
    seeds = 40  # one worker, one seed a batch, 1000 epochs each: seconds of training left when the first is in
    before = _run_ids(pipeline_copy, REPRODUCE_EXPERIMENT)
    process, err = _start_reproduce(pipeline_copy, tmp_path, {
        "reproduce.seeds": seeds, "reproduce.seeds_per_batch": 1, "reproduce.workers": 1,
        "reproduce.protocol.cora.optim.max_epochs": 1000, "reproduce.protocol.cora.optim.patience": 100000})

    def children() -> list:
        return [run for run in pipeline_copy.runs(REPRODUCE_EXPERIMENT)
                if run.info.run_id not in before and "mlflow.parentRunId" in run.data.tags]

    try:
        cleanup.watch(process.pid)
        assert _poll(lambda: process.poll() is not None or children(), START_S, 0.2), \
            f"no child run while reproduce trained:\n{err.read_text()}"
        assert process.poll() is None, err.read_text()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=STOP_S)
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM, err.read_text()
    parent = _new_run(pipeline_copy, REPRODUCE_EXPERIMENT, before)
    assert parent.info.status == "FAILED"
    finished = children()
    assert 1 <= len(finished) < seeds
    assert {run.data.tags["mlflow.parentRunId"] for run in finished} == {parent.info.run_id}
    assert {run.info.status for run in finished} == {"FINISHED"}
    assert sorted(int(run.data.tags["seed"]) for run in finished) == list(range(len(finished)))
    assert not (tmp_path / "out").exists()


def test_killed_reproduce_takes_its_workers_with_it(pipeline_copy: Pipeline, tmp_path: Path,
                                                    cleanup: Cleanup) -> None:
    before = _run_ids(pipeline_copy, REPRODUCE_EXPERIMENT)
    process, err = _start_reproduce(pipeline_copy, tmp_path)
    try:
        _wait_for_training(pipeline_copy, process, err, before)
        cleanup.watch(process.pid)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=STOP_S)
        started = time.monotonic()
        assert _poll(lambda: not _alive(cleanup.seen.values()), REAP_S), \
            f"orphaned: {[p.pid for p in _alive(cleanup.seen.values())]}"
        print(f"workers gone {time.monotonic() - started:.2f} s after the SIGKILL")
    finally:
        process.kill()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGHUP])
def test_a_stage_whose_dvc_dies_stops_and_writes_nothing(pipeline_copy: Pipeline, tmp_path: Path, cleanup: Cleanup,
                                                         signum: int) -> None:
    """`dvc repro` killed alone (not its process group): the train stage it ran stops on its own. SIGHUP goes to
    the whole process group, as the shell sends it to its jobs when the terminal closes: dvc and the stage get it."""
    pipeline_copy.set_params(**{"train.optim.max_epochs": 100000, "train.optim.patience": 100000})
    lock = (pipeline_copy.root / "dvc.lock").read_bytes()
    before = _run_ids(pipeline_copy, TRAIN_EXPERIMENT)
    # The stage inherits dvc's stdout and stderr: files, so that a failure shows what the stage said, and
    # PYTHONFAULTHANDLER, so that a stage still running at the end dumps every thread's stack there (SIGABRT).
    out, err = tmp_path / "dvc-stdout.txt", tmp_path / "dvc-stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        dvc = subprocess.Popen([*WITH_DEFAULT_SIGNALS, str(VENV_BIN / "dvc"), "repro", "train"], cwd=pipeline_copy.root,
                               env={**pipeline_copy.env, "PYTHONFAULTHANDLER": "1"}, stdout=stdout, stderr=stderr,
                               start_new_session=signum == signal.SIGHUP)
    try:
        def training() -> bool:
            run = _new_run(pipeline_copy, TRAIN_EXPERIMENT, before)
            return run is not None and run.info.status == "RUNNING"

        assert _poll(lambda: dvc.poll() is not None or training(), START_S, 0.5), "the train stage never started"
        assert dvc.poll() is None
        cleanup.watch(dvc.pid)
        assert any("stages.train" in " ".join(p.cmdline()) for p in _alive(cleanup.seen.values())), \
            "no train stage under dvc"
        if signum == signal.SIGHUP:
            os.killpg(dvc.pid, signum)
        else:
            dvc.send_signal(signum)
        dvc.wait(timeout=STOP_S)
        started = time.monotonic()
        if not _poll(lambda: not _alive(cleanup.seen.values()), STOP_S):
            pytest.fail(f"still running {STOP_S:.0f} s after dvc died: {_dump_stacks(cleanup.seen.values())}\n"
                        f"the stage's stderr:\n{err.read_text()[-6000:]}")
        print(f"train stage gone {time.monotonic() - started:.1f} s after dvc")
    finally:
        dvc.kill()
    if signum == signal.SIGKILL:  # dvc said nothing: the stage's one line says what happened
        assert (f"error: the parent process (dvc, pid {dvc.pid}) is gone: stopping; the MLflow run is marked FAILED "
                "and no output is written.") in err.read_text(), err.read_text()[-4000:]
    if signum == signal.SIGHUP:
        assert ("error: interrupted by SIGHUP: stopping; the MLflow run is marked FAILED and no output is written."
                in err.read_text()), err.read_text()[-4000:]
    run = _new_run(pipeline_copy, TRAIN_EXPERIMENT, before)
    assert run.info.status == "FAILED"
    assert "test_acc" not in run.data.metrics
    # dvc removed the stage's outputs before it ran it; nothing that dvc.lock does not record came back.
    assert (pipeline_copy.root / "dvc.lock").read_bytes() == lock
    assert list((pipeline_copy.root / "data/train").iterdir()) == []
