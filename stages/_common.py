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
from typing import Any, Iterator

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


def fail(message: str) -> None:
    raise StageError(message)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Validate the whole file, so that a bad key anywhere stops every stage before it works."""
    path = Path(path)
    if not path.is_file():
        fail(f"{path} not found: run the stage from the repository root (dvc repro does).")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        fail(f"{path} is not valid YAML: {error}")
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


def write_json(path: str | Path, payload: Any) -> None:
    write_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _raise_on_sigterm(signum: int, _frame: Any) -> None:
    # Turned into an exception so that context managers (the MLflow run, atomic outputs) clean up.
    raise SystemExit(128 + signum)


def main(run) -> None:
    """Run a stage's `run()`: user errors become one clear line and exit code 2."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # Measured on the 2-core machines: with 2 intra-op threads, MKL's sparse products stall
    # (16 ms instead of 0.04 ms for Cora's x @ W), so one thread per process is fastest;
    # the reproduce stage gets its parallelism from one process per core instead.
    torch.set_num_threads(1)
    try:
        run()
    except (ParamsError, StageError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
