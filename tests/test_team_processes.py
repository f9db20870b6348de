"""team.processes: a server's recorded PID names that very process, whatever the wall clock does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from team.processes import _record, recorded_pid
from team.settings import State


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A process that runs until the test ends, stopped by its PID."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_recorded_server_is_running_until_it_stops(tmp_path: Path, sleeper: int) -> None:
    state = State(tmp_path)
    _record(state, "mlflow", sleeper)
    assert recorded_pid(state, "mlflow") == sleeper
    psutil.Process(sleeper).kill()
    psutil.Process(sleeper).wait(timeout=10)
    assert recorded_pid(state, "mlflow") is None


def test_a_step_of_the_wall_clock_leaves_a_server_running(tmp_path: Path, sleeper: int, monkeypatch) -> None:
    """The clock set 3 s forward after `up` recorded the server: psutil's create_time and boot_time both move by 3 s
    (the boot time is what the kernel derives from the wall clock), and the server is still the one recorded."""
    state = State(tmp_path)
    _record(state, "seaweedfs", sleeper)
    create_time, boot_time = psutil.Process.create_time, psutil.boot_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: create_time(self) + 3.0)
    monkeypatch.setattr(psutil, "boot_time", lambda: boot_time() + 3.0)
    assert recorded_pid(state, "seaweedfs") == sleeper


def test_another_process_under_a_recorded_pid_is_not_the_server(tmp_path: Path, sleeper: int) -> None:
    """A PID the system gave to another process since: its start time is not the recorded one."""
    state = State(tmp_path)
    _record(state, "mlflow", sleeper)
    record = state.pids / "mlflow.json"
    recorded = json.loads(record.read_text())
    record.write_text(json.dumps(recorded | {"started_after_boot": recorded["started_after_boot"] - 60}))
    assert recorded_pid(state, "mlflow") is None


def test_a_record_of_an_earlier_version_is_still_read(tmp_path: Path, sleeper: int) -> None:
    """Servers started before the records held the time after boot keep being found (and stopped) by `team`."""
    state = State(tmp_path)
    state.pids.mkdir(parents=True)
    started_at = psutil.Process(sleeper).create_time()
    (state.pids / "mlflow.json").write_text(json.dumps({"pid": sleeper, "started_at": started_at}))
    assert recorded_pid(state, "mlflow") == sleeper
    (state.pids / "mlflow.json").write_text(json.dumps({"pid": sleeper, "started_at": started_at - 60}))
    assert recorded_pid(state, "mlflow") is None
