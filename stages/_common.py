"""What every stage script shares: params, the repo root, input checks and atomic outputs."""

from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import io
import json
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn

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


# YAML 1.2's floats without a dot (`1e9`, `5e-4`): PyYAML (YAML 1.1) reads them as strings, DVC (ruamel, YAML 1.2) as
# numbers; params.yaml means what DVC reads. Checked after PyYAML's own resolvers, so `5` stays an int.
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
                                       list("-+0123456789"))


def parse_params_yaml(text: str) -> Any:
    """params.yaml's text as DVC reads it, but strictly: a key set twice raises (a yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Validate the whole file, so that a bad key anywhere stops every stage before it works."""
    path = Path(path)
    if not path.is_file():
        fail(f"{path} not found: run the stage from the repository root (dvc repro does).")
    try:
        raw = parse_params_yaml(path.read_text())
    except _DuplicateKey as error:
        fail(f"{path}: {error}; delete one of them.")
    except yaml.MarkedYAMLError as error:
        # str(error) spans several lines with a source excerpt; the line number and the problem suffice.
        where = f" line {error.problem_mark.line + 1}" if error.problem_mark else ""
        fail(f"{path}{where} is not valid YAML: {error.problem or error.context}; fix it there.")
    except yaml.YAMLError as error:
        fail(f"{path} is not valid YAML: {' '.join(str(error).split())}")
    params = Params.from_dict(raw or {})
    check_tracking_uri()  # the other setting every stage reads, checked as early
    return params


# The URI schemes MLflow's tracking and registry stores both read (`postgresql+psycopg2` counts as postgresql);
# no scheme is a local folder.
TRACKING_SCHEMES = ("http", "https", "sqlite", "file", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
                    "uc")


def check_tracking_uri() -> None:
    """MLFLOW_TRACKING_URI, when set, names a store MLflow reads: `htp://host` would end, after the stage's
    work, in MLflow's UnsupportedModelRegistryStoreURIException traceback."""
    from urllib.parse import urlsplit

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    try:
        scheme = urlsplit(uri).scheme.lower()
    except ValueError as error:  # an unbalanced `[` in the host, ...
        scheme, problem = "", f"it is not a URI ({error})"
    else:
        problem = f"MLflow reads no `{scheme}://` store" if scheme else ""
    from stages._fetch import redact_urls

    if scheme.split("+")[0] in TRACKING_SCHEMES or not problem:
        problem = _store_unusable(uri, scheme)
        if problem:
            fail(f"MLFLOW_TRACKING_URI is {redact_urls(uri)!r}: {problem}")
        return
    fail(f"MLFLOW_TRACKING_URI is {redact_urls(uri)!r}: {problem}; it takes "
         f"{', '.join(f'{name}://' for name in TRACKING_SCHEMES[:7])} (a team server is http(s)://host:port). "
         "Fix it, or unset it to track into mlflow.db.")


# The Python module SQLAlchemy loads for each database scheme without a `+driver` (`mysql+pymysql` names its own).
DATABASE_DRIVERS = {"postgresql": "psycopg2", "mysql": "MySQLdb", "mssql": "pyodbc"}


def _store_unusable(uri: str, scheme: str) -> str:
    """Why a store MLflow reads can't be used from here (its driver is not installed; a SQLite file in a folder
    that does not exist, which MLflow would create without a word, often a typo), or ''."""
    import importlib.util

    kind, _, driver = scheme.partition("+")
    module = {"pymysql": "pymysql", "psycopg2": "psycopg2", "psycopg": "psycopg", "pyodbc": "pyodbc",
              "mysqldb": "MySQLdb"}.get(driver, driver) if driver else DATABASE_DRIVERS.get(kind)
    if module and importlib.util.find_spec(module) is None:
        return (f"its database driver `{module}` is not installed in this environment: install it into .venv "
                "(`.venv/bin/pip install ...`), or use a team server (http://) or SQLite.")
    if kind == "sqlite" and uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            return (f"the database's folder {folder} does not exist: create it, or fix the path "
                    "(sqlite:////absolute/path.db, or sqlite:///relative.db).")
    return ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (`error: ...`, exit 2), like every other error of a stage,
    and which calls the stage what a user types: `python -m stages.train`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage = sys._getframe(1).f_globals  # the stage module that makes the parser
        name = stage.get("__name__")
        if name == "__main__":  # run as `python -m stages.train`: its import name is its spec's
            name = getattr(stage.get("__spec__"), "name", None)
        if name:
            kwargs.setdefault("prog", f"python -m {name}")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`).\n")


def require(path: str | Path, producer: str) -> Path:
    """Fail with the stage to run when an upstream output is missing."""
    path = Path(path)
    if not path.exists():
        fail(f"{path} is missing: it is made by the `{producer}` stage. Run `dvc repro {producer}` first.")
    return path


# What a full disk (or quota) raises: one line for the user instead of a traceback.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def no_space(folder: str | Path | None) -> str:
    """What a full disk under `folder` (None: not known) means for the user, in one sentence."""
    where = (f"the device that holds {folder}" if folder is not None else
             f"a device this stage writes to (its outputs, the MLflow store, {tempfile.gettempdir()})")
    df = f"df -h {folder}" if folder is not None else "df -h"
    return f"no space left on {where}: free some space there (`{df}`), then rerun; no output was written"


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
    except OSError as error:
        if disk_full(error):
            fail(no_space(out.parent))
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_temporary(path: Path, data: bytes | str) -> Path:
    """`data` in a new temporary sibling of `path`, which is removed again if anything goes wrong."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False)
    temporary = Path(handle.name)
    try:
        with handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        temporary.chmod(0o644)  # NamedTemporaryFile creates 0600
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if disk_full(error):
            fail(no_space(path.parent))
        raise
    return temporary


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write a file through a temporary sibling and a rename. Inside `outputs_together`, the rename waits
    for the end of the block, with the other outputs'."""
    path = Path(path)
    temporary = _write_temporary(path, data)
    if _HOLD.depth:
        _HOLD.staged.append((temporary, path))
        return
    try:
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


def _damaged(path: Path, problem: str, producer: str) -> NoReturn:
    fail(f"{path}: {problem}. Run `dvc repro --force {producer}` to write it again.")


def _first_line(error: BaseException) -> str:
    """`Type: message`, cut at the message's first line or sentence (torch's run on for paragraphs)."""
    lines = str(error).strip().splitlines()
    first = lines[0].strip().split(". ")[0].rstrip(".") if lines else ""
    return f"{type(error).__name__}: {first[:160]}".rstrip(": ")


def load_tensors(path: str | Path, producer: str) -> Any:
    """`torch.load(path, weights_only=True)`, with a missing, truncated or refused file as one line.

    weights_only=True refuses any pickled object that is not a tensor or a plain container before it
    is built, so a planted payload is never run; its multi-paragraph error becomes one line here.
    """
    path = require(path, producer)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": a second line on stderr, before the error
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        # torch says "Unsupported global", "unsupported GLOBAL ... is blocked", ... by version and case.
        if any(word in str(error).lower() for word in ("unsupported", "blocked")):
            _damaged(path, "it holds objects other than tensors, numbers and plain containers "
                           "(torch.load(weights_only=True) refused them; nothing in it was run)", producer)
        _damaged(path, "not a readable torch file (its pickle is malformed)", producer)
    except (MemoryError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:  # a truncated zip, a bad header, ...: RuntimeError, EOFError, ValueError, ...
        _damaged(path, f"not a readable torch file ({_first_line(error)})", producer)


def load_json(path: str | Path, producer: str, keys: Mapping[str, type | tuple[type, ...]] | None = None
              ) -> dict[str, Any]:
    """A JSON object file with at least `keys` (name -> the JSON type of its value), or one line naming the
    file and the stage that writes it."""
    path = require(path, producer)
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        _damaged(path, f"not valid JSON ({_first_line(error)})", producer)
    if not isinstance(value, dict):
        _damaged(path, f"expected a JSON object, found a {type(value).__name__}", producer)
    keys = keys or {}
    missing = [key for key in keys if key not in value]
    if missing:
        _damaged(path, f"it lacks {', '.join(map(repr, missing))}", producer)
    for key, kind in keys.items():
        # bool is an int to isinstance; no key of these files is a bool.
        if not isinstance(value[key], kind) or isinstance(value[key], bool):
            _damaged(path, f"{key!r} is {value[key]!r}, a {type(value[key]).__name__}", producer)
    return value


# The train stage's run.json: what evaluate and analyze read from it, and its JSON types.
RUN_JSON: dict[str, type] = {"run_id": str, "model": str, "model_uri": str, "epochs": int, "best_epoch": int}


def load_prepared(folder: str | Path, dataset: str) -> tuple[Graph, dict[str, Any]]:
    """The preprocess stage's graph and meta.json, or an error naming the stage to run."""
    producer = f"preprocess@{dataset}"
    folder = require(folder, producer)
    for name in ("graph.pt", "meta.json"):
        require(folder / name, producer)
    meta = load_json(folder / "meta.json", producer, {"dataset": str, "source_sha256": dict})
    if meta["dataset"] != dataset:
        fail(f"{folder} holds {meta['dataset']!r}, not {dataset!r}: pass the folder of `{dataset}`.")
    tensors = load_tensors(folder / "graph.pt", producer)
    if not isinstance(tensors, dict):
        _damaged(folder / "graph.pt", f"expected a dict of tensors, found a {type(tensors).__name__}", producer)
    try:
        graph = graph_from_tensors(tensors)
    except (MemoryError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:  # a missing key (ValueError), a tensor of the wrong kind or shape, ...
        _damaged(folder / "graph.pt", f"not a saved graph ({_first_line(error)})", producer)
    sizes = {"num_nodes": graph.num_nodes, "num_features": graph.num_features, "num_classes": graph.num_classes}
    for key, size in sizes.items():  # another dataset's graph.pt copied in, say
        if key in meta and meta[key] != size:
            _damaged(folder / "graph.pt", f"its {key} is {size}, but meta.json says {meta[key]}", producer)
    return graph, meta


def load_model(folder: str | Path, producer: str = "train") -> tuple[dict[str, Any], Any]:
    """The train stage's `model.pt`: its state (gat.model.model_state) and the gat.model.GAT it holds, in
    eval mode; or one line naming the file."""
    from gat.model import model_from_state

    path = Path(folder) / "model.pt"
    state = load_tensors(path, producer)
    try:
        return state, model_from_state(state)
    except (MemoryError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:  # not a dict, a missing key, weights of another shape, ...
        _damaged(path, f"not a saved model ({_first_line(error)})", producer)


def device_for(name: str, key: str) -> torch.device:
    """The torch device that params.yaml's `key` names, or a one-line error when it is not there."""
    from gat.training import resolve_device

    try:
        return resolve_device(name)
    except ValueError as error:
        fail(f"params.yaml: `{key}`: {error}.")


class _OutputHold:
    """Whether a stage is writing its outputs, the stop (a signal number) that came meanwhile, and the files
    written so far (temporary, final path), renamed into place together when the block ends."""

    depth = 0
    held: int | None = None
    staged: list[tuple[Path, Path]] = []


_HOLD = _OutputHold()


@contextlib.contextmanager
def outputs_together() -> Iterator[None]:
    """A stage's outputs, all new or none: each `write_atomic` in the block writes its temporary file, and the
    renames come when every one is written, so a full disk or an error halfway leaves no output (and no
    temporary file). A stop (SIGTERM, Ctrl-C, a dead parent) is held meanwhile, milliseconds: it acts as the
    block ends, and the MLflow run then ends FAILED as usual.

    A flag that the stop handler reads, not a signal mask: the kernel hands a process's signal to any of
    its threads that doesn't block it, and Python then runs the handler in the main thread regardless.
    """
    _HOLD.depth += 1
    try:
        yield
        if _HOLD.depth == 1:
            while _HOLD.staged:
                temporary, path = _HOLD.staged[0]
                temporary.replace(path)  # a rename in one folder: it takes no space
                _HOLD.staged.pop(0)
    finally:
        _HOLD.depth -= 1
        if _HOLD.depth == 0:
            for temporary, _ in _HOLD.staged:  # the block failed: its files are not outputs
                temporary.unlink(missing_ok=True)
            _HOLD.staged.clear()
            if _HOLD.held is not None:
                signum, _HOLD.held = _HOLD.held, None
                signal.raise_signal(signum)


def write_json(path: str | Path, payload: Any) -> None:
    write_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


# How often a stage checks that its parent (dvc, a shell) is still there.
PARENT_POLL_S = 0.5
# How soon a stop that could not act yet (the main thread was in a database write) is tried again.
RETRY_STOP_S = 0.05
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


def _first_gone(lineage: list[int]) -> int | None:
    """The first process of `lineage` that is no longer where it was (each one the parent of the one before)."""
    if os.getppid() != lineage[0]:
        return lineage[0]
    for child, parent in zip(lineage, lineage[1:]):
        if _parent_of(child) != parent:
            return parent
    return None


class _Interrupts:
    """SIGTERM, SIGINT, SIGHUP and the death of the parent process all become one SystemExit in the main thread.

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

    def handle(self, signum: int, frame: Any) -> None:
        import time

        if self.pending is not None or self.exiting:
            return  # stopping already: let the cleanup finish
        if _HOLD.depth:
            _HOLD.held = signum  # outputs are being written: stop once they all are
            return
        if self.signum is None:
            self.signum, self.stop_asked = signum, time.monotonic()
            _say(f"error: {self.reason or f'interrupted by {signal.Signals(signum).name}'}: {_STOPPED}")
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
            elif not parent_gone and (gone := _first_gone(self.lineage)) is not None:
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


def _exit_now(code: int) -> NoReturn:
    """Exit once a stopped stage has cleaned up, without the interpreter's teardown.

    That teardown (finalize_modules: several full garbage collections over torch, MLflow, SQLAlchemy,
    pandas and pyarrow, then every module's objects freed one by one) costs about 2 s of CPU and saves
    nothing: on a busy machine it kept a stopped stage alive for 10 s and more after it had ended its run,
    with no thread left to force the exit (daemon threads, the watchdog included, are frozen once the
    interpreter finalizes). The atexit handlers still run (logging, MLflow, tempfile's and
    multiprocessing's finalizers: semaphores are unlinked, so the resource tracker has nothing to warn
    about), the watchdog still forcing the exit should one of them hang; then stdout and stderr are
    flushed and the process ends.
    """
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a pipe whose reader (a dead dvc) is gone
                pass
        os._exit(code)


def main(run) -> None:
    """Run a stage's `run()`: user errors become one clear line and exit code 2.

    SIGTERM, SIGINT (Ctrl-C) and the death of the parent process (dvc) stop the stage within a few
    seconds (under 1 s to act and end the MLflow run, then an exit that skips the interpreter's teardown),
    with one line on stderr, the MLflow run FAILED, no output written and exit code 128 + the signal
    (143; 130 for Ctrl-C).
    """
    # Measured on the 2-core machines: with 2 intra-op threads, MKL's sparse products stall
    # (16 ms instead of 0.04 ms for Cora's x @ W), so one thread per process is fastest;
    # the reproduce stage gets its parallelism from one process per core instead.
    torch.set_num_threads(1)
    # The process is the stage's own (`python -m stages.train`, run() defined in __main__), not a test that
    # calls main() in its own process: only then does a stop end the process at once.
    owns_process = getattr(run, "__module__", None) == "__main__"
    interrupts = _Interrupts()
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
    if interrupts.signum is not None and owns_process:  # stopped and cleaned up (or run() swallowed the stop)
        _exit_now(128 + interrupts.signum)
