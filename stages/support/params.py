"""Params and errors: the repo root, params.yaml read and validated, the tracking URI checked, one-line errors
(`fail`, `StageError`, an ArgumentParser whose errors are one line) and the device a key names."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml

from gat.config import Params
from gat.fused import requested_lanes
from stages.support.redaction import redact_urls


def repo_root() -> Path:
    """The repository that owns the tracking store.

    `dvc exp run --queue/--temp` runs stages in a temporary copy of the repo but sets
    DVC_ROOT to the original one, so runs land in the user's store and not in a copy
    that is deleted afterwards.
    """
    return Path(os.environ.get("DVC_ROOT") or Path(__file__).resolve().parents[2]).resolve()


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
    check_lanes_variable()
    return params


def check_lanes_variable() -> None:
    """$GAT_FUSED_LANES, which training reads, checked before any work."""
    try:
        requested_lanes()
    except ValueError as error:
        fail(str(error))


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


def device_for(name: str, key: str) -> torch.device:
    """The torch device that params.yaml's `key` names, or a one-line error when it is not there."""
    from gat.training import resolve_device

    try:
        return resolve_device(name)
    except ValueError as error:
        fail(f"params.yaml: `{key}`: {error}.")


