"""tools/local_server.py: the port check, starting a server that dies with its parent, waiting for it, and stopping
its whole group. Tiny `python -c` servers; every loop bounded, no duration asserted, leftovers killed by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import run_stage_in_process

from stages.support.params import StageError
from tools.local_server import check_port, free_port, group_running, start, stop, wait_until_answering

BOUND_S = 60.0  # the most any loop here waits (a busy 2-core machine); never asserted as a duration
# A server that answers 200 on every path.
HTTP = """import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""
# A server with a child that ignores SIGTERM, as a worker that lingers: each writes its PID to argv[1].
STUBBORN = """import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                          "open(%r, 'w').write('ready')\\ntime.sleep(600)" % (sys.argv[1] + ".child",)])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """The servers a test starts; whatever of their groups is left is killed by PID."""
    servers: list[subprocess.Popen] = []
    try:
        yield servers
    finally:
        for server in servers:
            for pid in group_running(server.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            server.kill()
            server.wait()


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + BOUND_S
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.05)
    return path.read_text()


def test_a_taken_port_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    hint = "use another: `make ui PORT=5001`"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = run_stage_in_process(monkeypatch, "tools.ui", lambda: check_port(port, hint))
    assert code == 2
    assert capsys.readouterr().err == (f"error: port {port} on 127.0.0.1 is taken (Address already in use): use "
                                       "another: `make ui PORT=5001`\n")


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_no_port_is_one_line(port: int) -> None:
    with pytest.raises(StageError) as raised:
        check_port(port, "PORT=...")
    assert str(raised.value) == f"port {port} is not a TCP port (1 to 65535): PORT=..."


def test_a_free_port_passes_the_check() -> None:
    check_port(free_port(), "unused")


def test_the_server_answers_then_stop_leaves_nothing(started: list[subprocess.Popen]) -> None:
    port = free_port()
    server = start([sys.executable, "-c", HTTP, str(port)])
    started.append(server)
    wait_until_answering(server, f"http://127.0.0.1:{port}/ping", "the test server", BOUND_S, lambda: "no log")
    assert group_running(server.pid) == [server.pid]  # the wrapper exec'd the server: same PID, one process
    stop(server)
    assert server.returncode == -signal.SIGTERM
    assert group_running(server.pid) == []


def test_a_server_that_exits_first_is_one_line(started: list[subprocess.Popen]) -> None:
    server = start([sys.executable, "-c", "import sys; sys.exit(3)"])
    started.append(server)
    with pytest.raises(StageError) as raised:
        wait_until_answering(server, f"http://127.0.0.1:{free_port()}/", "the test server", BOUND_S,
                             lambda: "its output is above")
    assert str(raised.value).startswith("the test server exited (code 3) before it answered on http://127.0.0.1:")
    assert str(raised.value).endswith(": its output is above") and "\n" not in str(raised.value)


def test_stop_kills_a_child_that_ignores_sigterm(started: list[subprocess.Popen], tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    server = start([sys.executable, "-c", STUBBORN, str(pids)])
    started.append(server)
    leader, child = map(int, _wait_for(pids).split())
    _wait_for(Path(f"{pids}.child"))  # SIGTERM is ignored from now on
    assert leader == server.pid and set(group_running(server.pid)) == {leader, child}
    stop(server, timeout_s=0.5)  # SIGTERM ends the leader; the child needs the SIGKILL
    assert group_running(server.pid) == []
    assert server.returncode == -signal.SIGTERM


def test_stop_waits_for_an_orphaned_child_of_a_reaped_leader(started: list[subprocess.Popen], tmp_path: Path) -> None:
    """The leader exits and is reaped; its child, reparented, still runs in the group: stop waits for it too."""
    pids = tmp_path / "pids"
    server = start([sys.executable, "-c", STUBBORN, str(pids)])
    started.append(server)
    leader, child = map(int, _wait_for(pids).split())
    _wait_for(Path(f"{pids}.child"))
    os.kill(leader, signal.SIGKILL)
    server.wait()  # reaped: kill(-pgid, 0) alone would still see the child, or a zombie of it
    assert group_running(server.pid) == [child]
    stop(server, timeout_s=0.5)
    assert group_running(server.pid) == []


def test_the_server_dies_with_its_parent(tmp_path: Path) -> None:
    """SIGKILL to the process that started the server: the kernel sends the server SIGTERM (PR_SET_PDEATHSIG)."""
    pid_file = tmp_path / "server"
    parent = subprocess.Popen([sys.executable, "-c", f"""import sys, time
from tools.local_server import start
server = start([sys.executable, "-c", "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                "time.sleep(600)"])
time.sleep(600)
"""], cwd=Path(__file__).resolve().parents[1])
    server_pid = 0
    try:
        server_pid = int(_wait_for(pid_file))
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + BOUND_S
        while group_running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_running(server_pid) == []
    finally:
        parent.kill()
        parent.wait()
        for pid in group_running(server_pid) if server_pid else []:
            os.kill(pid, signal.SIGKILL)


def test_a_signal_during_the_stop_does_not_cut_it_short(started: list[subprocess.Popen]) -> None:
    """The server answers its SIGTERM with one to this process, as a second Ctrl-C while the stop runs."""
    received: list[int] = []
    server = start([sys.executable, "-c", "import os, signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda *_: (os.kill(os.getppid(), signal.SIGTERM), sys.exit(0)))\n"
                    "print('ready', flush=True)\ntime.sleep(600)"], output=subprocess.PIPE)
    started.append(server)
    assert server.stdout is not None and server.stdout.readline() == b"ready\n"
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        stop(server)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # this process's handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert server.returncode == 0 and group_running(server.pid) == [] and received == []
