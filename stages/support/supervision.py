"""Process supervision: whether the process that started this one is still there, polled every PARENT_POLL_S.

One definition, two reactions. A stage (stages.support.interrupts) watches its lineage, dvc through the shells
between them, and stops in order when one is gone (its MLflow run FAILED, no output). A pool worker
(stages.support.local_pool), which has nothing to save, is killed by the kernel with its parent
(PR_SET_PDEATHSIG); where that is missing (not Linux), it exits here instead (exit_with_parent).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

# How often a process checks that its parent (dvc, a shell; a worker's stage) is still there.
PARENT_POLL_S = 0.5
# dvc runs a stage's cmd with `/bin/sh -c` (or $SHELL), and Debian's dash does not exec the command: when
# dvc dies, the shell lives on as the stage's parent. The watchdog looks through shells to the first
# process that is not one.
SHELLS = frozenset({"sh", "dash", "bash", "zsh", "fish", "ksh", "mksh", "busybox"})


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def process_name(pid: int) -> str:
    comm = _comm(pid)
    return f"{comm}, pid {pid}" if comm else f"pid {pid}"


def _parent_of(pid: int) -> int | None:
    """The parent's pid from /proc/<pid>/stat, or None once `pid` is gone. The command name (field 2) may
    hold spaces and parentheses, so the fields are counted after its closing parenthesis."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def lineage() -> list[int]:
    """This process's parent, and its ancestors up to the first that is not a shell (dvc, say)."""
    chain = [os.getppid()]
    while _comm(chain[-1]) in SHELLS:
        grandparent = _parent_of(chain[-1])
        if grandparent is None or grandparent <= 1:
            break
        chain.append(grandparent)
    return chain


def first_gone(lineage: list[int]) -> int | None:
    """The first process of `lineage` that is no longer where it was (each one the parent of the one before)."""
    if os.getppid() != lineage[0]:
        return lineage[0]
    for child, parent in zip(lineage, lineage[1:]):
        if _parent_of(child) != parent:
            return parent
    return None


def exit_with_parent(parent_pid: int) -> None:
    """A daemon thread that ends this process (exit status 1, no clean-up) once `parent_pid` is no longer its
    parent: for a process with nothing to save, where the kernel can't be asked to kill it (PR_SET_PDEATHSIG)."""
    def watch() -> None:
        while first_gone([parent_pid]) is None:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
