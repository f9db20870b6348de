"""The team servers as processes: started in a session of their own with their PID recorded in the state folder,
waited for until they answer, and stopped by that PID (never by name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from team.settings import State, TeamError, say

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


def _started_after_boot(pid: int) -> float | None:
    """When `pid` started, in seconds after the machine booted. psutil's create_time is that plus the boot time as the
    wall clock now puts it, so a step of the clock (a VM's clock set right, NTP) moves it; less the boot time read
    the same way, the step cancels out."""
    import psutil

    try:
        return psutil.Process(pid).create_time() - psutil.boot_time()
    except psutil.Error:
        return None


def _record(state: State, name: str, pid: int) -> None:
    state.pids.mkdir(parents=True, exist_ok=True)
    record = {"pid": pid, "started_after_boot": _started_after_boot(pid)}
    (state.pids / f"{name}.json").write_text(json.dumps(record) + "\n")


def recorded_pid(state: State, name: str) -> int | None:
    """The PID `up` recorded for `name`, if that very process (same start time) still runs."""
    if name == "postgres":
        pid_file = state.pgdata / "postmaster.pid"
        if not pid_file.exists():
            return None
        pid = int(pid_file.read_text().split("\n", 1)[0])
        return pid if _started_after_boot(pid) is not None else None
    record = state.pids / f"{name}.json"
    if not record.exists():
        return None
    recorded = json.loads(record.read_text())
    started = _started_after_boot(recorded["pid"])
    if started is None:
        return None
    if "started_after_boot" not in recorded:  # a record of an earlier version: the start time on the wall clock
        import psutil

        started, expected = started + psutil.boot_time(), recorded.get("started_at") or 0
    else:
        expected = recorded["started_after_boot"]
    return recorded["pid"] if abs(started - expected) < 1 else None


def _wait(condition: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def stop_server(state: State, name: str) -> bool:
    """Stop one server by its recorded PID, SIGKILL after STOP_TIMEOUT_S; whether it was running.

    PostgreSQL gets SIGINT (a fast shutdown), and its postmaster stops its own children. The others get SIGTERM
    to their process group, theirs alone (each runs in a session of its own): the mlflow CLI and its uvicorn
    workers, or weed.
    """
    pid = recorded_pid(state, name)
    if pid is not None:
        if name == "postgres":
            send, first, stopped = os.kill, signal.SIGINT, lambda: not _alive([pid])
        else:
            send, first, stopped = os.killpg, signal.SIGTERM, lambda: not _alive(_group(pid))
        send(pid, first)
        if not _wait(stopped, STOP_TIMEOUT_S):
            send(pid, signal.SIGKILL)
            _wait(stopped, STOP_TIMEOUT_S)
        say(f"stopped {name} (pid {pid})")
    if name == "seaweedfs":
        _remove_weed_sockets(state)
    (state.pids / f"{name}.json").unlink(missing_ok=True)
    return pid is not None


def _remove_weed_sockets(state: State) -> None:
    """The Unix sockets (0700, the backend user's) that weed opens in /tmp for its gRPC ports, and may leave."""
    try:
        settings = state.load()
    except (OSError, ValueError, TypeError):  # unreadable settings: nothing to go by
        return
    for name, port in (settings.ports if settings else {}).items():
        if name.endswith("_grpc"):
            component = name.removesuffix("_grpc")
            Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock").unlink(missing_ok=True)


def _group(pgid: int) -> list[int]:
    """The processes of a process group."""
    import psutil

    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _alive(pids: list[int]) -> bool:
    """Whether any of `pids` still runs: a zombie (exited, not yet reaped by its parent) does not."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


def spawn(state: State, name: str, command: list[str], env: dict[str, str], umask: int = -1) -> subprocess.Popen:
    """Start a server in a session of its own (so it outlives `make`, and `down` can stop its whole group);
    `umask` 0o077 makes every file it creates its owner's alone."""
    state.logs.mkdir(parents=True, exist_ok=True)
    with (state.logs / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, cwd=state.root, start_new_session=True, umask=umask)
    _record(state, name, process.pid)
    return process


def wait_ready(name: str, process: subprocess.Popen | None, ready: Callable[[], bool], log: Path) -> None:
    def done() -> bool:
        if process is not None and process.poll() is not None:
            return True
        try:
            return ready()
        except Exception:  # noqa: BLE001  (not up yet: connection refused, 503, ...)
            return False

    if not _wait(done, START_TIMEOUT_S, 0.5) or (process is not None and process.poll() is not None):
        raise TeamError(f"{name} did not start within {START_TIMEOUT_S:.0f} s: see {log}")
