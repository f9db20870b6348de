"""A process pool whose workers never outlive the stage, nor keep it waiting once it is told to stop.

    with worker_pool(2) as pool:
        for result in pool.map(function, jobs_a, jobs_b):   # in order, each as soon as it is ready
            ...
        for index, result in pool.as_completed(function, shared, jobs):   # as each job finishes
            ...

- On any exception in the block (a failed job, SystemExit from stages.support.interrupts' SIGTERM/SIGINT
  handler, KeyboardInterrupt), pending jobs are cancelled and the workers are killed at once
  (SIGKILL: a worker in the middle of a batch has nothing to save), instead of the executor's
  usual wait for the running jobs.
- When the stage process itself dies, even by SIGKILL, the kernel kills its workers
  (PR_SET_PDEATHSIG, armed by each worker once it has started: then it also renames itself
  WORKER_NAME, as `ps` and `top` show it). A worker still starting (importing torch and the
  stage's modules, a few seconds) when its parent dies exits as soon as it has started.
  Where prctl is missing (not Linux), a thread in each worker polls the parent instead
  (stages.support.supervision, the stage's own watchdog's test of a parent gone).
- Jobs' tensors reach the workers as file descriptors, handed over by a thread of multiprocessing's
  (resource_sharer) in the stage. A worker killed while it fetches one leaves that thread a reset
  connection, which it prints as a traceback; once the pool has killed its workers, that is expected
  and not shown.
- Workers ignore SIGINT and SIGHUP: Ctrl-C and a closed terminal reach the whole foreground process
  group, and the parent, not each worker, decides what happens (it kills them), so there is one message, not one
  traceback per worker.

The workers are started with the "spawn" method (no fork of a process that holds threads
and torch state). They import the stage's main module only when the function of the job that
starts them (the pool's first) is defined there (stages.support.main_module); the stages' jobs
live in stages.support.seed_task, so a worker imports what they need, not MLflow and the rest
of the stage. `worker_pool(n, preload)` has each worker import the modules `preload` as it starts, and
`pool.start()` starts them all before any job: the stages start theirs as they open their MLflow run
(stages.support.seed_pool.starting_pool), so that the two overlap. PR_SET_PDEATHSIG fires when the *thread*
that started a worker exits, so a pool is used by the thread that created it (in the stages, the main thread);
`start`, `map` and `as_completed` refuse any other thread.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.resource_sharer import _ResourceSharer  # type: ignore[attr-defined]  # private, not in typeshed
from types import TracebackType
from typing import Any, Callable, Iterable, Iterator, Sequence

from stages.support.main_module import main_module_hidden
from stages.support.params import fail
from stages.support.supervision import exit_with_parent, first_gone

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# What `ps`, `top` and psutil call a worker once it is armed to die with its parent (its comm, at most 15 bytes).
WORKER_NAME = "gat-worker"
# How often a waiting parent wakes up to run signal handlers (a signal that the kernel delivered to
# another thread only reaches the main thread's Python handler when that thread runs Python code).
_POLL_S = 0.5
# How long to wait for killed workers to be reaped; SIGKILL acts in milliseconds.
_REAP_S = 10.0
# The signals that reach a whole process group (Ctrl-C; a closed terminal, through the shell): the stage decides.
_GROUP_SIGNALS = {signal.SIGINT, signal.SIGHUP}


def _die_with_parent(parent_pid: int) -> None:
    """In a worker: be killed by the kernel when the parent dies; exit now if it already has.

    This runs once the worker has started (imported the stage's modules, a few seconds): a worker
    whose parent dies before then exits right here.
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
            if armed:
                libc.prctl(_PR_SET_NAME, WORKER_NAME.encode(), 0, 0, 0)
        except (OSError, AttributeError):
            armed = False
    # The parent may have died before prctl: the worker was then re-parented and nothing will signal it.
    if first_gone([parent_pid]) is not None:
        os._exit(1)
    if not armed:  # no prctl (another OS): watch the parent instead
        exit_with_parent(parent_pid)


# In a worker: why one of the pool's `preload` modules did not import, which each of its jobs then raises (_job).
_PRELOAD_FAILED: str | None = None


def _start_worker(parent_pid: int, preload: Sequence[str]) -> None:
    global _PRELOAD_FAILED
    for signum in _GROUP_SIGNALS:  # held since the worker was started; ignored for good
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    for module in preload:  # armed first: a parent that dies meanwhile takes the worker with it
        try:
            importlib.import_module(module)
        except Exception as error:  # an initializer's exception would only break the pool: "a worker died"
            _PRELOAD_FAILED = (f"a worker process could not import {module} ({type(error).__name__}: {error}): "
                               "fix it, then rerun the stage")
            return


def _job(function: Callable[..., Any], *args: Any) -> Any:
    """What a worker runs for each job: `function(*args)`, or the one-line error of a preload that failed."""
    if _PRELOAD_FAILED is not None:
        fail(_PRELOAD_FAILED)
    return function(*args)


def _spawned() -> None:
    """WorkerPool.start's job: none; submitting it makes the executor spawn a worker."""


def _handover_to_a_killed_worker(kind: type[BaseException], traceback: TracebackType | None) -> bool:
    """Whether an exception is multiprocessing's resource_sharer losing a worker in the middle of handing it a
    file descriptor (the worker was killed): the connection reset or closed, raised in that thread's loop."""
    if not issubclass(kind, (ConnectionError, EOFError)):
        return False
    return traceback is not None and traceback.tb_frame.f_code is _ResourceSharer._serve.__code__


def _quiet_handovers_to_killed_workers() -> None:
    """From now on, don't print the resource_sharer's traceback when a handover's worker is gone (it prints
    through sys.excepthook, from a loop that goes on serving); every other exception is printed as before."""
    previous = sys.excepthook
    if getattr(previous, "quiet_handovers", False):
        return

    def excepthook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        if not _handover_to_a_killed_worker(kind, traceback):
            previous(kind, error, traceback)

    excepthook.quiet_handovers = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


@contextlib.contextmanager
def _group_signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGHUP in this thread while it starts processes (the workers, and multiprocessing's
    resource tracker, which ignores SIGINT and SIGTERM but not SIGHUP): they inherit the blocked mask, so the
    signals never reach them, not even while a worker imports its modules. One that comes meanwhile reaches
    the stage when they are released."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _result(future: concurrent.futures.Future) -> Any:
    """A finished job's result; its exception, or one line when its worker died under it (killed, the OOM killer):
    the executor then fails every job, and the stage kills the other workers on its way out."""
    try:
        return future.result()
    except concurrent.futures.process.BrokenProcessPool:
        fail("a worker process died while it ran a job (killed, or out of memory: see `dmesg`); the other "
             "workers are stopped: rerun the stage")


class WorkerPool:
    """`workers` spawned processes; see the module docstring. Use it as a context manager."""

    def __init__(self, workers: int, preload: Sequence[str] = ()) -> None:
        self._owner = threading.get_ident()
        self.size = workers
        self._others = set(multiprocessing.active_children())  # children that are not this pool's
        self._futures: list[concurrent.futures.Future] = []  # every job submitted
        with _group_signals_held():  # its queues' locks start the resource tracker
            self._executor = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker, initargs=(os.getpid(), tuple(preload)))

    def start(self) -> None:
        """Start every worker now, instead of with the first jobs: each imports the pool's `preload` modules (what
        the jobs to come need) while the stage goes on with its own set-up (its MLflow run: a second of CPU,
        against about a second per worker). Nothing waits here; the jobs then run in order as before. Workers
        started this way skip the stage's main module (stages.support.main_module): no job may be defined there."""
        if threading.get_ident() != self._owner:
            raise RuntimeError("a WorkerPool is used by the thread that created it (its workers die with it)")
        # With "spawn" the executor starts a worker for each job submitted while none is idle: one job per worker
        # (a worker that is up at once may take two of them; the others are started all the same).
        for _ in range(self.size):
            self._submit(_spawned)

    def _submit(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        # The first submit starts the workers; they need the main module only for a job defined there.
        main_needed = getattr(function, "__module__", "__main__") == "__main__"
        with _group_signals_held(), contextlib.nullcontext() if main_needed else main_module_hidden():
            future = self._executor.submit(_job, function, *args)
        self._futures.append(future)
        return future

    def map(self, function: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        """`function(*args)` for each tuple of arguments, in a worker; the results in the order of the
        arguments, each as soon as it and those before it are done. All jobs are queued at once.

        A job that raises raises here as soon as it fails, not once the jobs before it are done.
        """
        if threading.get_ident() != self._owner:
            raise RuntimeError("a WorkerPool is used by the thread that created it (its workers die with it)")
        futures = [self._submit(function, *args) for args in zip(*iterables)]

        def results() -> Iterator[Any]:
            pending = set(futures)
            for future in futures:
                while not future.done():
                    done, pending = concurrent.futures.wait(pending, timeout=_POLL_S,
                                                            return_when=concurrent.futures.FIRST_COMPLETED)
                    for finished in done:
                        if not finished.cancelled() and finished.exception() is not None:
                            _result(finished)  # raises the job's exception
                yield _result(future)

        return results()

    def as_completed(self, function: Callable[..., Any], shared: Any,
                     jobs: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, Any]]:
        """`function(shared, *job)` for each job, in a worker; (the job's index, its result) as each is done.

        The interface of stages.support.dask_pool.DaskPool.as_completed, which ships `shared` to each worker once;
        here it
        travels with every job. A job that raises raises here as soon as it fails.
        """
        if threading.get_ident() != self._owner:
            raise RuntimeError("a WorkerPool is used by the thread that created it (its workers die with it)")
        futures = {self._submit(function, shared, *job): index for index, job in enumerate(jobs)}
        pending = set(futures)
        while pending:
            # A bounded wait, so that a signal delivered to another thread reaches the main thread's handler.
            done, pending = concurrent.futures.wait(pending, timeout=_POLL_S,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for finished in sorted(done, key=futures.__getitem__):
                yield futures[finished], _result(finished)  # raises the job's exception

    def workers(self) -> list[multiprocessing.process.BaseProcess]:
        """This pool's live worker processes: the children started since the pool was made."""
        return [process for process in multiprocessing.active_children() if process not in self._others]

    def terminate(self) -> None:
        """Cancel the pending jobs and kill the workers now; returns once they are reaped."""
        _quiet_handovers_to_killed_workers()
        self._kill_workers()

    def _kill_workers(self) -> None:
        workers = self.workers()
        for process in workers:
            process.kill()
        deadline = time.monotonic() + _REAP_S
        for process in workers:
            process.join(max(0.0, deadline - time.monotonic()))
        # With its workers dead, the executor marks what is left broken and its thread ends at once.
        self._executor.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Cancel the jobs not started, let the running ones finish, stop the workers. Once every job is done the
        workers are idle and are killed, not told to exit: a worker's exit runs the interpreter's teardown of torch
        (0.6 s), which the stage would wait for."""
        if all(future.done() for future in self._futures):
            self._kill_workers()  # no job left, so no handover to them either: a reset one is still shown
        else:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.terminate()


def worker_pool(workers: int, preload: Sequence[str] = ()) -> WorkerPool:
    """A pool of `workers` processes that die with the stage and are killed on any exception; each imports the
    modules `preload` as it starts."""
    return WorkerPool(workers, preload)
