"""A local HTTP server process for a command (tools.ui's `mlflow ui`, tools.serve's `mlflow models serve`): its port
on 127.0.0.1 checked, started in a process group of its own that dies with this process, waited for until it
answers, and stopped, its whole group, by its PID (never by name).

    check_port(port, "give another with PORT=...")       # one line and exit 2 when it is taken
    server = start(command, env=env)
    try:
        wait_until_answering(server, f"http://{HOST}:{port}/ping", "the model server", 180, lambda: "...")
        server.wait()
    finally:
        stop(server)

Signals are stages.support.interrupts.main's (the command runs under it): the first Ctrl-C, SIGTERM or SIGHUP
stops the command, and `stop` ignores more of them until the server's group is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Callable, Iterator

from stages.support.local_pool import PR_SET_PDEATHSIG
from stages.support.params import fail

HOST = "127.0.0.1"  # these servers are for this machine only: never another interface
# How long the server and its workers get to end after SIGTERM before they are killed (and then to be gone).
STOP_TIMEOUT_S = 10.0
POLL_S = 0.25
_STOP_POLL_S = 0.05


def free_port() -> int:
    """A port no one listens on now, on HOST (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def check_port(port: int, hint: str) -> None:
    """One line and exit 2 (stages.support.params.fail) when `port` is not a TCP port, or is taken on HOST; `hint`
    says what to do instead (`make ui PORT=5001`, `PORT=...`). Bound as uvicorn binds it (SO_REUSEADDR), so a port
    in TIME_WAIT after the last server is not called taken."""
    if not 1 <= port <= 65535:
        fail(f"port {port} is not a TCP port (1 to 65535): {hint}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError as error:
            taken = "is taken" if error.errno == errno.EADDRINUSE else "cannot be used"
            fail(f"port {port} on {HOST} {taken} ({error.strerror}): {hint}")


# Runs the server's command (argv[2:]) once the kernel is asked to SIGTERM it when this process dies, even by
# SIGKILL (PR_SET_PDEATHSIG, as stages.support.local_pool's workers; it survives the exec, and the mlflow CLI passes
# SIGTERM on to its uvicorn). The server has its own process group (Ctrl-C is this process's to handle), so nothing
# else would end it. A wrapper that execs, rather than a preexec_fn doing the same prctl: preexec_fn runs Python
# in the child of a fork of this multi-threaded process (stages.support.interrupts' watchdog thread), which Python
# documents as unsafe (a lock held by another thread at the fork deadlocks it), and it has no way to see that this
# process died before the prctl; the wrapper checks its parent after it (exit 1: nobody is left to serve), and the
# Popen can use vfork. Without prctl (not Linux), only `stop` ends the server.
_DIE_WITH_PARENT = f"""import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def start(command: list[str], env: dict[str, str] | None = None, output: IO | int | None = None) -> subprocess.Popen:
    """Start `command` (its first item a path) in a session of its own, its stdout and stderr to `output` (None:
    this process's): the terminal's Ctrl-C reaches this process only, which stops the server's whole group
    (`stop`). The kernel sends it SIGTERM when this process dies."""
    wrapped = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
    return subprocess.Popen(wrapped, env=env, stdin=subprocess.DEVNULL, stdout=output,
                            stderr=subprocess.STDOUT if output is not None else None, start_new_session=True)


# Loopback only: never through a proxy from http_proxy and the like.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def answers(url: str) -> bool:
    """Whether `url` answers 200 now."""
    try:
        with _LOCAL.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # refused while it starts, an HTTP error, or a timeout
        return False


def wait_until_answering(server: subprocess.Popen, url: str, name: str, timeout_s: float,
                         details: Callable[[], str]) -> None:
    """Return once `url` answers 200; one line and exit 2 when `server` exits first, or after `timeout_s`.
    `name` is what the line calls the server, `details()` where its output is (read when it is said)."""
    deadline = time.monotonic() + timeout_s
    while not answers(url):
        if server.poll() is not None:
            fail(f"{name} exited (code {server.returncode}) before it answered on {url}: {details()}")
        if time.monotonic() > deadline:
            fail(f"{name} did not answer on {url} within {timeout_s:.0f} s: {details()}")
        time.sleep(POLL_S)


def group_running(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run. A zombie (exited, not yet reaped) does not, though
    kill(-pgid, 0) still succeeds for it: when the group's leader has been reaped, its children are reparented,
    and a parent that never reaps them (a container's PID 1) would keep the group "alive" forever."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: zombies cannot be told apart
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    running = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
            if int(pgrp) == pgid and state not in "ZX":
                running.append(int(entry.name))
    return running


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP ignored while a group is stopped (this process is stopping already, and the first
    of them was stages.support.interrupts' to act on): a stop cut short would leave the server's workers running.
    Only the main thread may change signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM,
                                                                               signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: not installed from Python, nothing to restore
                signal.signal(signum, handler)


def stop(server: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to the server's process group (the server and its workers), SIGKILL to what is left after
    `timeout_s`; returns once no process of the group runs (the server can exit before its workers have), its
    leader reaped. (Only a process stuck in the kernel outlasts SIGKILL, and only for `timeout_s` more.)"""
    with _uninterrupted():
        _stop(server, timeout_s)


def _stop(server: subprocess.Popen, timeout_s: float) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        server.poll()  # reaps the leader once it has exited
        if not group_running(server.pid):
            break
        try:
            os.killpg(server.pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout_s
        while group_running(server.pid) and time.monotonic() < deadline:
            server.poll()
            time.sleep(_STOP_POLL_S)
    server.wait()
