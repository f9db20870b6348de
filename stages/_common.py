"""What every stage script shares: params, the repo root, input checks and atomic outputs."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, NoReturn

import torch
import yaml

from gat.config import Params, ParamsError
from gat.data import Graph, graph_from_tensors


def repo_root() -> Path:
    """The repository that owns the tracking store.

    `dvc exp run --queue/--temp` runs stages in a temporary copy of the repo but sets
    DVC_ROOT to the original one, so runs land in the user's store and not in a copy
    that is deleted afterwards.
    """
    return Path(os.environ.get("DVC_ROOT") or Path(__file__).resolve().parents[1]).resolve()


class StageError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


def fail(message: str) -> NoReturn:
    raise StageError(message)


class _DuplicateKey(yaml.YAMLError):
    """A key set twice in one mapping of params.yaml; the lines are 1-based."""

    def __init__(self, key: Any, first_line: int, line: int) -> None:
        super().__init__(f"`{key}` is set twice in the same mapping, on lines {first_line} and {line}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key set twice in one mapping, where PyYAML silently keeps the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                duplicate = key in first_lines
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error for it follows
            if duplicate:
                raise _DuplicateKey(key, first_lines[key], line)
            first_lines[key] = line
        return super().construct_mapping(node, deep)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Validate the whole file, so that a bad key anywhere stops every stage before it works."""
    path = Path(path)
    if not path.is_file():
        fail(f"{path} not found: run the stage from the repository root (dvc repro does).")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as error:
        fail(f"{path}: {error}; delete one of them.")
    except yaml.MarkedYAMLError as error:
        # str(error) spans several lines with a source excerpt; the line number and the problem suffice.
        where = f" line {error.problem_mark.line + 1}" if error.problem_mark else ""
        fail(f"{path}{where} is not valid YAML: {error.problem or error.context}; fix it there.")
    except yaml.YAMLError as error:
        fail(f"{path} is not valid YAML: {' '.join(str(error).split())}")
    return Params.from_dict(raw or {})


def require(path: str | Path, producer: str) -> Path:
    """Fail with the stage to run when an upstream output is missing."""
    path = Path(path)
    if not path.exists():
        fail(f"{path} is missing: it is made by the `{producer}` stage. Run `dvc repro {producer}` first.")
    return path


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces `out` only if the block succeeds.

    A crash or a bad input leaves the previous `out` (or nothing) behind, never a half-written one.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would otherwise become the output's mode
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write a file through a temporary sibling and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        temporary = Path(handle.name)
    try:
        temporary.chmod(0o644)  # NamedTemporaryFile creates 0600
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Rows of equal keys as CSV with a header (DVC plots read it)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buffer.getvalue())


def load_prepared(folder: str | Path, dataset: str) -> tuple[Graph, dict[str, Any]]:
    """The preprocess stage's graph and meta.json, or an error naming the stage to run."""
    folder = require(folder, f"preprocess@{dataset}")
    for name in ("graph.pt", "meta.json"):
        require(folder / name, f"preprocess@{dataset}")
    meta = json.loads((folder / "meta.json").read_text())
    if meta["dataset"] != dataset:
        fail(f"{folder} holds {meta['dataset']!r}, not {dataset!r}: pass the folder of `{dataset}`.")
    return graph_from_tensors(torch.load(folder / "graph.pt", weights_only=True)), meta


def device_for(name: str, key: str) -> torch.device:
    """The torch device that params.yaml's `key` names, or a one-line error when it is not there."""
    from gat.training import resolve_device

    try:
        return resolve_device(name)
    except ValueError as error:
        fail(f"params.yaml: `{key}`: {error}.")


class _OutputHold:
    """Whether a stage is writing its outputs, and the stop (a signal number) that came meanwhile."""

    depth = 0
    held: int | None = None


_HOLD = _OutputHold()


@contextlib.contextmanager
def outputs_together() -> Iterator[None]:
    """Hold a stop (SIGTERM, Ctrl-C, a dead parent) while a stage writes its outputs, milliseconds, so that
    a stop leaves all of them new or none: the held stop acts as the block ends, and the MLflow run then
    ends FAILED as usual.

    A flag that the stop handler reads, not a signal mask: the kernel hands a process's signal to any of
    its threads that doesn't block it, and Python then runs the handler in the main thread regardless.
    """
    _HOLD.depth += 1
    try:
        yield
    finally:
        _HOLD.depth -= 1
        if _HOLD.depth == 0 and _HOLD.held is not None:
            signum, _HOLD.held = _HOLD.held, None
            signal.raise_signal(signum)


def write_json(path: str | Path, payload: Any) -> None:
    write_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


# How often a stage checks that its parent (dvc, a shell) is still there.
PARENT_POLL_S = 0.5
# dvc runs a stage's cmd with `/bin/sh -c` (or $SHELL), and Debian's dash does not exec the command: when
# dvc dies, the shell lives on as the stage's parent. The watchdog looks through shells to the first
# process that is not one.
SHELLS = frozenset({"sh", "dash", "bash", "zsh", "fish", "ksh", "mksh", "busybox"})
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


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _process_name(pid: int) -> str:
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


def _lineage() -> list[int]:
    """This process's parent, and its ancestors up to the first that is not a shell (dvc, say)."""
    chain = [os.getppid()]
    while _comm(chain[-1]) in SHELLS:
        grandparent = _parent_of(chain[-1])
        if grandparent is None or grandparent <= 1:
            break
        chain.append(grandparent)
    return chain


def _first_gone(lineage: list[int]) -> int | None:
    """The first process of `lineage` that is no longer where it was (each one the parent of the one before)."""
    if os.getppid() != lineage[0]:
        return lineage[0]
    for child, parent in zip(lineage, lineage[1:]):
        if _parent_of(child) != parent:
            return parent
    return None


class _Interrupts:
    """SIGTERM, SIGINT and the death of the parent process all become one SystemExit in the main thread.

    An exception, not an exit, so that the context managers clean up on the way out: the MLflow run
    ends FAILED (stages._tracking.stage_run), atomic outputs are discarded, worker processes are
    killed (stages._workers). It is raised once: a second Ctrl-C while that cleanup runs (about a
    second) would interrupt it and leave the run RUNNING. Raised again only when Python swallowed it:
    a signal handler runs wherever the main thread is, a finalizer or weakref callback included, and
    an exception there is printed as "Exception ignored" and dropped. FORCE_EXIT_S after the stop,
    the process exits whatever it is doing.
    """

    def __init__(self) -> None:
        import threading

        self.lineage = _lineage()
        self.names = {pid: _process_name(pid) for pid in self.lineage}
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

    def handle(self, signum: int, _frame: Any) -> None:
        import time

        if self.pending is not None or self.exiting:
            return  # stopping already: let the cleanup finish
        if _HOLD.depth:
            _HOLD.held = signum  # outputs are being written: stop once they all are
            return
        stop = self.pending = SystemExit(128 + (self.signum or signum))
        if self.signum is None:
            self.signum, self.stop_asked = signum, time.monotonic()
            _say(f"error: {self.reason or f'interrupted by {signal.Signals(signum).name}'}: {_STOPPED}")
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
            self.wake.wait(PARENT_POLL_S)
            self.wake.clear()
            if self.done.is_set():
                return
            if self.signum is not None:
                if time.monotonic() - self.stop_asked > FORCE_EXIT_S:
                    _say(f"error: still running {FORCE_EXIT_S:.0f} s after the stop: exiting without cleaning up.")
                    os._exit(128 + self.signum)
                if self.pending is None and not self.exiting:
                    signal.pthread_kill(self.main_thread, self.signum)
            elif not parent_gone and (gone := _first_gone(self.lineage)) is not None:
                parent_gone = True
                self.reason = f"the parent process ({self.names[gone]}) is gone"
                # To the main thread itself, so that a blocking wait there is interrupted at once.
                signal.pthread_kill(self.main_thread, signal.SIGTERM)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        watched = [signal.SIGTERM]
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job (`cmd &`) keeps ignoring it
            watched.append(signal.SIGINT)
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


def main(run) -> None:
    """Run a stage's `run()`: user errors become one clear line and exit code 2.

    SIGTERM, SIGINT (Ctrl-C) and the death of the parent process (dvc) stop the stage within a few
    seconds (under 1 s to act, then the interpreter's own shutdown), with one line on stderr, the MLflow
    run FAILED, no output written and exit code 128 + the signal (143; 130 for Ctrl-C).
    """
    # Measured on the 2-core machines: with 2 intra-op threads, MKL's sparse products stall
    # (16 ms instead of 0.04 ms for Cora's x @ W), so one thread per process is fastest;
    # the reproduce stage gets its parallelism from one process per core instead.
    torch.set_num_threads(1)
    with _Interrupts().installed():
        try:
            run()
        except (ParamsError, StageError) as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
