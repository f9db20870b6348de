"""Interrupts: SIGTERM, Ctrl-C, SIGHUP and a dead parent (stages.support.supervision) stop a stage within seconds,
with its MLflow run FAILED and no output; `main` runs a stage under them."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn

import torch

from gat.config import ParamsError
from stages.support.files import OUTPUT_HOLD, disk_full, no_space
from stages.support.params import StageError
from stages.support.supervision import PARENT_POLL_S, first_gone, lineage, process_name

# How soon a stop that could not act yet (the main thread was in a database write) is tried again.
RETRY_STOP_S = 0.05
# The last resort when a stop was asked for and the stage still runs (the SystemExit was swallowed by code
# that catches everything): exit without cleaning up. Cleaning up takes about a second.
FORCE_EXIT_S = 30.0
_STOPPED = "stopping; the MLflow run is marked FAILED and no output is written."


def _say(line: str) -> None:
    """One line on stderr, which may be a pipe whose reader (a dead dvc) is gone."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


# Code that a stop must not interrupt halfway: a SystemExit raised inside an SQLAlchemy session (MLflow's store) can
# leave its connection checked out in an open SQLite write transaction, and the stage's cleanup, which ends the run
# FAILED through another connection, then waits on that lock: 20 s of MLflow's busy_timeout per write, in C.
_UNINTERRUPTIBLE = frozenset({"sqlalchemy", "mlflow", "alembic", "sqlite3"})


def _inside_uninterruptible(frame: Any) -> bool:
    """Whether the main thread, stopped at `frame`, is inside _UNINTERRUPTIBLE's packages."""
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).partition(".")[0] in _UNINTERRUPTIBLE:
            return True
        frame = frame.f_back
    return False


class _Interrupts:
    """SIGTERM, SIGINT, SIGHUP and the death of the parent process all become one SystemExit in the main thread.

    An exception, not an exit, so that the context managers clean up on the way out: the MLflow run
    ends FAILED (stages.support.tracking.stage_run), atomic outputs are discarded, worker processes are
    killed (stages.support.local_pool). It is raised once: a second Ctrl-C while that cleanup runs (about a
    second) would interrupt it and leave the run RUNNING. Raised again only when Python swallowed it:
    a signal handler runs wherever the main thread is, a finalizer or weakref callback included, and
    an exception there is printed as "Exception ignored" and dropped. FORCE_EXIT_S after the stop,
    the process exits whatever it is doing.
    """

    def __init__(self, stopping: str = _STOPPED) -> None:
        import threading

        self.stopping = stopping  # what the stop line says happens next
        self.lineage = lineage()
        self.names = {pid: process_name(pid) for pid in self.lineage}
        self.main_thread = threading.get_ident()  # signal handlers only install from the main thread
        self.reason: str | None = None  # why the watchdog stops the stage, when it does
        self.signum: int | None = None  # the stop asked for, once it is
        self.stop_asked = 0.0
        self.pending: SystemExit | None = None  # the stop raised in the main thread, unless it was swallowed
        self.exiting = False  # run() is over: nothing left to interrupt
        self.done = threading.Event()
        self.wake = threading.Event()
        self.previous_hook = sys.unraisablehook
        self.watchdog = threading.Thread(target=self._watch, name="stage-watchdog", daemon=True)

    def handle(self, signum: int, frame: Any) -> None:
        import time

        if self.pending is not None or self.exiting:
            return  # stopping already: let the cleanup finish
        if OUTPUT_HOLD.depth:
            OUTPUT_HOLD.held = signum  # outputs are being written: stop once they all are
            return
        if self.signum is None:
            self.signum, self.stop_asked = signum, time.monotonic()
            _say(f"error: {self.reason or f'interrupted by {signal.Signals(signum).name}'}: {self.stopping}")
        if _inside_uninterruptible(frame):
            return  # not here: the watchdog sends the signal again every RETRY_STOP_S, until it lands outside
        stop = self.pending = SystemExit(128 + self.signum)
        raise stop

    def unraisable(self, info: Any) -> None:
        if self.pending is not None and info.exc_value is self.pending and not self.exiting:
            self.pending = None  # swallowed: the watchdog raises it again, out of this finalizer
            self.wake.set()
        else:
            self.previous_hook(info)

    def _watch(self) -> None:
        """When dvc dies (even by SIGKILL), the stage is re-parented: stop it rather than let it finish
        unseen, writing outputs that no dvc.lock records. Repeat a swallowed stop; force a stuck one."""
        import time

        parent_gone = False
        while not self.done.is_set():
            # A stop asked for but not raised yet (deferred out of a database write, or swallowed): soon again.
            self.wake.wait(RETRY_STOP_S if self.signum is not None and self.pending is None else PARENT_POLL_S)
            self.wake.clear()
            if self.done.is_set():
                return
            if self.signum is not None:
                if time.monotonic() - self.stop_asked > FORCE_EXIT_S:
                    _say(f"error: still running {FORCE_EXIT_S:.0f} s after the stop: exiting without cleaning up.")
                    os._exit(128 + self.signum)
                if self.pending is None and not self.exiting:
                    signal.pthread_kill(self.main_thread, self.signum)
            elif not parent_gone and (gone := first_gone(self.lineage)) is not None:
                parent_gone = True
                self.reason = f"the parent process ({self.names[gone]}) is gone"
                # To the main thread itself, so that a blocking wait there is interrupted at once.
                signal.pthread_kill(self.main_thread, signal.SIGTERM)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        # SIGHUP is a closed terminal (or ssh session): like SIGTERM. Each is left alone where it is ignored already:
        # SIGINT by a background job (`cmd &`), SIGHUP under `nohup`.
        watched = [signal.SIGTERM, *(signum for signum in (signal.SIGINT, signal.SIGHUP)
                                     if signal.getsignal(signum) is not signal.SIG_IGN)]
        previous = {signum: signal.signal(signum, self.handle) for signum in watched}
        sys.unraisablehook = self.unraisable
        self.watchdog.start()
        try:
            yield
        finally:
            if self.signum is None:
                self.done.set()
                self.wake.set()
                sys.unraisablehook = self.previous_hook
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            else:  # on the way out: signals do nothing more, and the watchdog forces a stuck exit
                self.exiting = True


def _exit_now(code: int, join_threads: bool = False) -> NoReturn:
    """Exit once a stage is done, or stopped and cleaned up, without the interpreter's teardown.

    That teardown (finalize_modules: several full garbage collections over torch, MLflow, SQLAlchemy,
    pandas and pyarrow, then every module's objects freed one by one) costs about 2 s of CPU and saves
    nothing: on a busy machine it kept a stopped stage alive for 10 s and more after it had ended its run,
    with no thread left to force the exit (daemon threads, the watchdog included, are frozen once the
    interpreter finalizes). The atexit handlers still run (logging, MLflow, tempfile's and
    multiprocessing's finalizers: semaphores are unlinked, so the resource tracker has nothing to warn
    about), the watchdog still forcing the exit should one of them hang; then stdout and stderr are
    flushed and the process ends. A stage that is done (`join_threads`) first waits for its other non-daemon
    threads, as the interpreter would (threading._shutdown, which also tells concurrent.futures' idle workers to
    end); a stopped one does not wait for them. For a stage that is done, the teardown was 1.2 to 1.5 s of wall time
    after its last atexit handler (reproduce@cora, 3 runs each way, AMD EPYC): every stage process of `dvc repro`
    paid it.
    """
    import atexit
    import threading

    try:
        if join_threads:
            threading._shutdown()  # type: ignore[attr-defined]  # private: what Py_FinalizeEx calls first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a pipe whose reader (a dead dvc) is gone
                pass
        os._exit(code)


def main(run, stopping: str = _STOPPED, one_thread: bool = True) -> None:
    """Run a stage's `run()`: user errors become one clear line and exit code 2.

    SIGTERM, SIGINT (Ctrl-C) and the death of the parent process (dvc) stop the stage within a few
    seconds (under 1 s to act and end the MLflow run, then an exit that skips the interpreter's teardown),
    with one line on stderr, the MLflow run FAILED, no output written and exit code 128 + the signal
    (143; 130 for Ctrl-C). A stage that is done exits 0 without the interpreter's teardown too (_exit_now).
    `one_thread`: False leaves torch's intra-op threads as they are (the benchmark, whose PyG rows time both counts).
    """
    # Measured on the 2-core machines: with 2 intra-op threads, MKL's sparse products stall
    # (16 ms instead of 0.04 ms for Cora's x @ W), so one thread per process is fastest;
    # the reproduce stage gets its parallelism from one process per core instead.
    if one_thread:
        torch.set_num_threads(1)
    # The process is the stage's own (`python -m stages.train`, run() defined in __main__), not a test that
    # calls main() in its own process: only then does a stop end the process at once.
    owns_process = getattr(run, "__module__", None) == "__main__"
    interrupts = _Interrupts(stopping)
    try:
        with interrupts.installed():
            try:
                run()
            except (ParamsError, StageError) as error:
                print(f"error: {error}", file=sys.stderr)
                sys.exit(2)
            except OSError as error:  # a full disk anywhere else (a temporary folder, say): the run is FAILED already
                if not disk_full(error):
                    raise
                print(f"error: {no_space(Path(error.filename).parent if error.filename else None)}", file=sys.stderr)
                sys.exit(2)
    except BaseException as error:
        if interrupts.signum is None or not owns_process:
            raise
        if not isinstance(error, SystemExit):
            import traceback

            traceback.print_exc()  # a bug in the cleanup after a stop: shown, as Python would
    if owns_process:  # done, or stopped and cleaned up (or run() swallowed the stop)
        signum = interrupts.signum
        _exit_now(0 if signum is None else 128 + signum, join_threads=signum is None)
