"""A process pool whose workers never outlive the stage, nor keep it waiting once it is told to stop.

    with worker_pool(2) as pool:
        for result in pool.map(function, jobs_a, jobs_b):   # in order, each as soon as it is ready
            ...
        for index, result in pool.as_completed(function, shared, jobs):   # as each job finishes
            ...

- On any exception in the block (a failed job, SystemExit from stages._common's SIGTERM/SIGINT
  handler, KeyboardInterrupt), pending jobs are cancelled and the workers are killed at once
  (SIGKILL: a worker in the middle of a batch has nothing to save), instead of the executor's
  usual wait for the running jobs.
- When the stage process itself dies, even by SIGKILL, the kernel kills its workers
  (PR_SET_PDEATHSIG, armed by each worker once it has started: then it also renames itself
  WORKER_NAME, as `ps` and `top` show it). A worker still starting (importing torch and the
  stage's modules, a few seconds) when its parent dies exits as soon as it has started.
  Where prctl is missing (not Linux), a thread in each worker polls the parent instead.
- Workers ignore SIGINT: Ctrl-C reaches the whole foreground process group, and the parent,
  not each worker, decides what happens (it kills them), so there is one message, not one
  traceback per worker.

The workers are started with the "spawn" method (no fork of a process that holds threads
and torch state). PR_SET_PDEATHSIG fires when the *thread* that started a worker exits, so
a pool is used by the thread that created it (in the stages, the main thread); `map` refuses
any other thread.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any, Callable, Iterable, Iterator, Sequence

# <linux/prctl.h>
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# What `ps`, `top` and psutil call a worker once it is armed to die with its parent (its comm, at most 15 bytes).
WORKER_NAME = "gat-worker"
# How often a waiting parent wakes up to run signal handlers (a signal that the kernel delivered to
# another thread only reaches the main thread's Python handler when that thread runs Python code).
_POLL_S = 0.5
# How long to wait for killed workers to be reaped; SIGKILL acts in milliseconds.
_REAP_S = 10.0


def _die_with_parent(parent_pid: int) -> None:
    """In a worker: be killed by the kernel when the parent dies; exit now if it already has.

    This runs once the worker has started (imported the stage's modules, a few seconds): a worker
    whose parent dies before then exits right here.
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
            if armed:
                libc.prctl(_PR_SET_NAME, WORKER_NAME.encode(), 0, 0, 0)
        except (OSError, AttributeError):
            armed = False
    # The parent may have died before prctl: the worker was then re-parented and nothing will signal it.
    if os.getppid() != parent_pid:
        os._exit(1)
    if not armed:  # no prctl (another OS): watch the parent instead
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    os._exit(1)


def _start_worker(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)


class WorkerPool:
    """`workers` spawned processes; see the module docstring. Use it as a context manager."""

    def __init__(self, workers: int) -> None:
        self._owner = threading.get_ident()
        self.size = workers
        self._others = set(multiprocessing.active_children())  # children that are not this pool's
        self._executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker, initargs=(os.getpid(),))

    def map(self, function: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        """`function(*args)` for each tuple of arguments, in a worker; the results in the order of the
        arguments, each as soon as it and those before it are done. All jobs are queued at once.

        A job that raises raises here as soon as it fails, not once the jobs before it are done.
        """
        if threading.get_ident() != self._owner:
            raise RuntimeError("a WorkerPool is used by the thread that created it (its workers die with it)")
        futures = [self._executor.submit(function, *args) for args in zip(*iterables)]

        def results() -> Iterator[Any]:
            pending = set(futures)
            for future in futures:
                while not future.done():
                    done, pending = concurrent.futures.wait(pending, timeout=_POLL_S,
                                                            return_when=concurrent.futures.FIRST_COMPLETED)
                    for finished in done:
                        if not finished.cancelled() and finished.exception() is not None:
                            finished.result()  # raises the job's exception
                yield future.result()

        return results()

    def as_completed(self, function: Callable[..., Any], shared: Any,
                     jobs: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, Any]]:
        """`function(shared, *job)` for each job, in a worker; (the job's index, its result) as each is done.

        The interface of stages._dask.DaskPool.as_completed, which ships `shared` to each worker once; here it
        travels with every job. A job that raises raises here as soon as it fails.
        """
        if threading.get_ident() != self._owner:
            raise RuntimeError("a WorkerPool is used by the thread that created it (its workers die with it)")
        futures = {self._executor.submit(function, shared, *job): index for index, job in enumerate(jobs)}
        pending = set(futures)
        while pending:
            # A bounded wait, so that a signal delivered to another thread reaches the main thread's handler.
            done, pending = concurrent.futures.wait(pending, timeout=_POLL_S,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for finished in sorted(done, key=futures.__getitem__):
                yield futures[finished], finished.result()  # raises the job's exception

    def workers(self) -> list[multiprocessing.process.BaseProcess]:
        """This pool's live worker processes: the children started since the pool was made."""
        return [process for process in multiprocessing.active_children() if process not in self._others]

    def terminate(self) -> None:
        """Cancel the pending jobs and kill the workers now; returns once they are reaped."""
        workers = self.workers()
        for process in workers:
            process.kill()
        deadline = time.monotonic() + _REAP_S
        for process in workers:
            process.join(max(0.0, deadline - time.monotonic()))
        # With its workers dead, the executor marks what is left broken and its thread ends at once.
        self._executor.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Cancel the jobs not started, let the running ones finish, stop the workers."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.terminate()


def worker_pool(workers: int) -> WorkerPool:
    """A pool of `workers` processes that die with the stage and are killed on any exception."""
    return WorkerPool(workers)
