"""The README's commands, run as written: its bash blocks, parsed from the README so that the tests cannot drift
from it, and a shell that runs them one by one as a user's terminal would.

- `readme_blocks(heading)`: the commands of each bash block in one section of the README (`readme_section`,
  `bash_blocks`, `commands`: its parts).
- `ReadmeShell`: runs those commands from a folder; `cd`, `source` and `export` carry over to the next command, a
  command ending in `&` runs in the background and `stop` ends it, with every process it started, by PID. A test
  substitutes only what it must (a port, a placeholder such as `<the group's git remote>`), through `replace`.
- `process_tree`, `stop_all`: a process and its descendants; SIGTERM, then SIGKILL, for a list of them.
- `unclaimable_ports`: free ports for the README's fixed ones, below the kernel's ephemeral range.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import subprocess
from pathlib import Path

import psutil
from pipeline_support import REPO, VENV_BIN

STAGE_S = 300.0  # how long a tiny stage may take, start to end, on a busy 2-core machine


def readme_section(heading: str) -> str:
    """The README's section `heading` (a whole `## ` line), up to the next `## `."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(f"\n{heading}\n"):]
    return section[:section.index("\n## ", 1)]


def commands(block: str) -> list[str]:
    """The commands of one bash block, comments dropped, continuations joined."""
    joined = re.sub(r"\\\n\s*", "", block)
    lines = [re.split(r"\s+#\s", line)[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each bash block in `text` (a block may be indented, in a list item)."""
    return [commands(block) for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def readme_blocks(heading: str) -> list[list[str]]:
    """The commands of each bash block in the README's section `heading`."""
    return bash_blocks(readme_section(heading))


def as_if_make_made_the_venv(clone: Path) -> None:
    """The test's venv as the clone's `.venv`, and the clone's files older than its stamps, as in a clone where `make`
    has made .venv: the recipe's `make` targets then install nothing (there is no network here)."""
    (clone / ".venv").symlink_to(VENV_BIN.parent)
    with (clone / ".git/info/exclude").open("a") as exclude:
        exclude.write(".venv\n")  # .gitignore's `.venv/` matches a folder, not this link
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=clone, capture_output=True, text=True, check=True)
    subprocess.run(["xargs", "-0", "touch", "-h", "-d", "2000-01-01"], input=tracked.stdout, cwd=clone, text=True,
                   check=True)


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def stop_all(processes: list[psutil.Process], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL what is left after `timeout`; returns once all are gone."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _gone, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=timeout)


def unclaimable_ports(count: int) -> list[int]:
    """`count` distinct ports that no one listens on now, below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range). A port of that range (what binding port 0 gives) can be taken between
    the pick and the server's start, as the local end of any outgoing connection; a Dask cluster's processes make
    many. Below the range only another explicit bind can take it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    chosen: list[int] = []
    for port in random.sample(range(1024, low), min(200, low - 1024)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise AssertionError(f"fewer than {count} free ports below {low}")


class ReadmeShell:
    """Runs README commands as written, from `root`, as one shell session would: after a command, its `cd` and
    `source` parts (`git clone ... && cd x`, `source .team/env`) apply to every later one, and `export` sets the
    environment; a command ending in `&` runs in the background (stopped by `stop`, by PID), the others in the
    foreground, and must succeed. Only the texts in `replace` change (ports, placeholders, host names). `wrap`
    prefixes every command line, e.g. `ip netns exec <host>` to run it on another host (tests/netns_support.py)."""

    def __init__(self, root: Path, env: dict[str, str], folder: Path, replace: dict[str, str] | None = None,
                 wrap: list[str] | None = None) -> None:
        self.root, self.env, self.folder = root, dict(env), folder
        self.replace = dict(replace or {})
        self.wrap = list(wrap or [])
        self.prefix = ""
        self.background: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}  # a background command's PID: where its stderr goes

    def line(self, command: str) -> str:
        for readme, ours in self.replace.items():
            command = command.replace(readme, ours)
        return command

    def run(self, command: str, *, env: dict[str, str] | None = None, timeout: float = STAGE_S
            ) -> subprocess.CompletedProcess | None:
        command = self.line(command)
        if command.startswith("export "):
            name, value = command.removeprefix("export ").split("=", 1)
            self.env[name] = value
            return None
        if command.endswith("&"):
            path = self.folder / f"background-{len(self.logs)}.log"
            with path.open("w") as log:
                self.background.append(subprocess.Popen(
                    [*self.wrap, "bash", "-c", self.prefix + command.removesuffix("&")], cwd=self.root,
                    env=self.env | (env or {}), stdout=subprocess.DEVNULL, stderr=log))
            self.logs[self.background[-1].pid] = path
            return None
        done = subprocess.run([*self.wrap, "bash", "-c", self.prefix + command], cwd=self.root,
                              env=self.env | (env or {}), capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        for part in command.split(" && "):
            if part.startswith(("cd ", "source ")):
                self.prefix += part + " && "
        return done

    def background_logs(self, lines: int = 20) -> str:
        """The last `lines` of every background command's stderr, for a failing assertion's message."""
        return "\n".join(f"--- {popen.args[-1]} (exit {popen.poll()}):\n"
                         + "\n".join(self.logs[popen.pid].read_text(errors="replace").splitlines()[-lines:])
                         for popen in self.background)

    def stop(self, popens: list[subprocess.Popen] | None = None) -> None:
        chosen = self.background if popens is None else popens
        everything = [process for popen in chosen for process in process_tree(popen.pid)]
        stop_all(everything)
        for popen in chosen:
            popen.wait(timeout=10)
        self.background = [popen for popen in self.background if popen not in chosen]
        assert not [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
