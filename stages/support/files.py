"""Files a stage reads and writes: inputs checked (a missing or damaged one is a one-line error naming its
stage), outputs written atomically, and a stage's outputs renamed into place together."""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import pickle
import shutil
import signal
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn

import torch

from gat.data import Graph, graph_from_tensors
from stages.support.params import fail


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
    if OUTPUT_HOLD.depth:
        OUTPUT_HOLD.staged.append((temporary, path))
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


def _whole_numbers(values: list, below: int | None = None) -> bool:
    """Every value a JSON integer (not a bool) >= 0, and < `below` when given."""
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v and (below is None or v < below)
               for v in values)


def load_evaluation(folder: str | Path, num_nodes: int, num_classes: int) -> tuple[list[int], list[list[int]]]:
    """The evaluate stage's `evaluation.json`: every node's predicted class and the test confusion matrix
    (rows actual, columns predicted), checked against the graph's sizes; or one line naming the file."""
    path = Path(folder) / "evaluation.json"
    found = load_json(path, "evaluate", {"predicted": list, "confusion": list})
    predicted, confusion = found["predicted"], found["confusion"]
    if len(predicted) != num_nodes or not _whole_numbers(predicted, num_classes):
        _damaged(path, f"'predicted' is not a class in [0, {num_classes}) for each of the graph's {num_nodes} "
                       f"nodes (it has {len(predicted)} entries)", "evaluate")
    if (len(confusion) != num_classes
            or not all(isinstance(row, list) and len(row) == num_classes and _whole_numbers(row) for row in confusion)):
        _damaged(path, f"'confusion' is not a {num_classes} x {num_classes} matrix of counts", "evaluate")
    return predicted, confusion


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


class OutputHold:
    """Whether a stage is writing its outputs, the stop (a signal number) that came meanwhile, and the files
    written so far (temporary, final path), renamed into place together when the block ends."""

    depth = 0
    held: int | None = None
    staged: list[tuple[Path, Path]] = []


OUTPUT_HOLD = OutputHold()


@contextlib.contextmanager
def outputs_together() -> Iterator[None]:
    """A stage's outputs, all new or none: each `write_atomic` in the block writes its temporary file, and the
    renames come when every one is written, so a full disk or an error halfway leaves no output (and no
    temporary file). A stop (SIGTERM, Ctrl-C, a dead parent) is held meanwhile, milliseconds: it acts as the
    block ends, and the MLflow run then ends FAILED as usual.

    A flag that the stop handler reads, not a signal mask: the kernel hands a process's signal to any of
    its threads that doesn't block it, and Python then runs the handler in the main thread regardless.
    """
    OUTPUT_HOLD.depth += 1
    try:
        yield
        if OUTPUT_HOLD.depth == 1:
            while OUTPUT_HOLD.staged:
                temporary, path = OUTPUT_HOLD.staged[0]
                temporary.replace(path)  # a rename in one folder: it takes no space
                OUTPUT_HOLD.staged.pop(0)
    finally:
        OUTPUT_HOLD.depth -= 1
        if OUTPUT_HOLD.depth == 0:
            for temporary, _ in OUTPUT_HOLD.staged:  # the block failed: its files are not outputs
                temporary.unlink(missing_ok=True)
            OUTPUT_HOLD.staged.clear()
            if OUTPUT_HOLD.held is not None:
                signum, OUTPUT_HOLD.held = OUTPUT_HOLD.held, None
                signal.raise_signal(signum)


def write_json(path: str | Path, payload: Any) -> None:
    write_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


