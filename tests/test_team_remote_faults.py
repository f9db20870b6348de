"""The team's DVC remote when its object store stops answering, against the real servers (team_support).

SeaweedFS frozen (SIGSTOP: its port still accepts connections, nothing answers) is what a hung or overloaded
store looks like: `dvc push` and `dvc pull` end with DVC's error and a non-zero exit within a bounded time,
because `python -m team remote` sets the remote's timeouts (team.settings.DVC_REMOTE_TIMEOUTS), and the store
works again once it is thawed. The freeze is always undone, and the store checked to answer again, so later
tests in the session keep it.
Plain DVC repositories of a few random bytes stand for the pipeline: no stage has to run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import psutil
from pipeline_support import VENV_BIN, Pipeline, clean_env
from team_support import TeamBackend, healthy, with_team_remote

from team.settings import DVC_REMOTE_NAME, DVC_REMOTE_TIMEOUTS

# How long a push or pull against the frozen store may take: measured ~100 s with DVC_REMOTE_TIMEOUTS (both
# were still running, silent, after 200 s without them).
FROZEN_S = 400.0


@contextlib.contextmanager
def seaweedfs_frozen(backend: TeamBackend) -> Iterator[None]:
    """SIGSTOP to the weed process and its children for the block; SIGCONT however the block ends."""
    pid = backend.pids()["seaweedfs"]
    assert pid is not None, "SeaweedFS is not running"
    weed = psutil.Process(pid)
    processes = [weed, *weed.children(recursive=True)]
    try:
        for process in processes:
            process.send_signal(signal.SIGSTOP)
        yield
    finally:
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGCONT)
        # The store the session shares, left as it was found: answering, both buckets there, for every later test.
        assert healthy(backend), "SeaweedFS did not answer again after SIGCONT"


def _repository(root: Path, backend: TeamBackend) -> Pipeline:
    """A git + DVC repository at `root` with one tracked file, whose remote is the team's (`make team-remote`)."""
    root.mkdir()
    repo = Pipeline(root, clean_env() | backend.mlflow_env)
    repo.run("git", "init", "-q", "-b", "main")
    repo.dvc("init", "-q")
    _track(repo, "first.bin")
    with_team_remote(repo, backend)
    return repo


def _track(repo: Pipeline, name: str) -> None:
    """A new file of random bytes, `dvc add`ed and committed."""
    (repo.root / name).write_bytes(os.urandom(200_000))
    repo.dvc("add", "-q", name)
    repo.commit(f"add {name}")


def _all_at_once(*repos_and_commands: tuple[Pipeline, tuple[str, ...]]) -> list[subprocess.CompletedProcess]:
    """Each DVC command in its repository, all at once; each must end within FROZEN_S, or is killed."""
    began = time.monotonic()
    started = [(subprocess.Popen([str(VENV_BIN / "dvc"), *command], cwd=repo.root, env=repo.env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), command)
               for repo, command in repos_and_commands]
    done = []
    try:
        for process, command in started:
            stdout, stderr = process.communicate(timeout=FROZEN_S)
            done.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
            print(f"dvc {' '.join(command)} against a frozen store: exit {process.returncode} after "
                  f"{time.monotonic() - began:.0f} s (-s shows this line)")
    finally:
        for process, _command in started:
            process.kill()
            process.wait()
    return done


def test_push_and_pull_against_a_frozen_store_fail_and_work_once_it_thaws(team_backend: TeamBackend,
                                                                           tmp_path: Path) -> None:
    mine = _repository(tmp_path / "mine", team_backend)
    config = (mine.root / ".dvc/config.local").read_text()
    assert all(f"{key} = {value}" in config for key, value in DVC_REMOTE_TIMEOUTS.items()), config
    mine.dvc("push")
    theirs_root = tmp_path / "theirs"
    subprocess.run(["git", "clone", "-q", str(mine.root), str(theirs_root)], check=True)
    theirs = Pipeline(theirs_root, mine.env)  # an empty cache: everything comes from the remote
    with_team_remote(theirs, team_backend)
    _track(mine, "second.bin")  # something to push

    with seaweedfs_frozen(team_backend):
        push, pull = _all_at_once((mine, ("push",)), (theirs, ("pull",)))

    for done in (push, pull):
        assert done.returncode != 0, done.stdout + done.stderr
        # Over HTTPS, a frozen store takes the TCP connection (the kernel does) but never the TLS handshake: a
        # connect timeout, where plain HTTP timed out reading the answer.
        assert "ERROR:" in done.stderr and re.search("(Connect|Read) timeout on endpoint URL", done.stderr), done.stderr
        assert team_backend.settings.s3_endpoint in done.stderr, done.stderr
    assert not (theirs_root / "first.bin").exists()
    # Thawed, the store has lost nothing and takes the push; the pull gets both files.
    mine.dvc("push")
    theirs.run("git", "pull", "-q", str(mine.root), "main")
    theirs.dvc("pull")
    for name in ("first.bin", "second.bin"):
        assert (theirs_root / name).read_bytes() == (mine.root / name).read_bytes()


def test_rerunning_team_remote_keeps_the_users_timeouts(team_backend: TeamBackend, tmp_path: Path) -> None:
    """`dvc remote modify --local team read_timeout 30`, as the README says, survives `make team-remote`."""
    repo = _repository(tmp_path / "repo", team_backend)
    repo.dvc("remote", "modify", "--local", DVC_REMOTE_NAME, "read_timeout", "30")
    with_team_remote(repo, team_backend)
    config = (repo.root / ".dvc/config.local").read_text()
    assert "read_timeout = 30" in config and f"connect_timeout = {DVC_REMOTE_TIMEOUTS['connect_timeout']}" in config
