"""The test suite itself under SIGTERM (tests/conftest.py's pytest_configure): pytest tears its fixtures down, so the
servers they started stop, before it exits as interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline_support import REPO

# A test run by a child pytest with this repository's conftest: it starts, then waits for its parent's SIGTERM.
PROBE = '''
import time
from pathlib import Path

import pytest


@pytest.fixture
def folder():
    folder = Path(__file__).parent
    yield folder
    (folder / "torn-down").write_text("the fixture's teardown ran")


def test_waits_for_sigterm(folder):
    (folder / "started").write_text("")
    time.sleep(60)  # bounded: the parent sends SIGTERM within seconds
'''


def test_sigterm_tears_the_fixtures_down_before_the_suite_exits(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:randomly", "-p", "no:cacheprovider",
               "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")]
    child = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "started").exists(), "the probe never started"
        child.send_signal(signal.SIGTERM)
        output, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert (tmp_path / "torn-down").exists(), output
    assert child.returncode == 2, output  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output and "signal SIGTERM" in output
