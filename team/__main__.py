"""`python -m team up|down|status|remote|issue`: see team.backend and team.tls."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from team.backend import configure_dvc_remote, down, issue_for, status, up
from team.ports import PORT_ENV
from team.settings import Settings, State, TeamError, default_state


def check_settings(state: State) -> None:
    """settings.json, when there is one, as `State.load` needs it, or a TeamError of one line.

    The file holds the passwords the servers were set up with, so it is never rewritten here: the line says
    what is wrong and how to recover.
    """
    path = state.settings_file
    if not path.exists():
        return
    recover = (f"restore it from a backup, or, to start a new and empty backend, stop the servers whose pids are in "
               f"{state.pids} and delete {state.root}")
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TeamError(f"{path} is not valid JSON ({' '.join(str(error).split())}): {recover}") from None
    if not isinstance(value, dict):
        raise TeamError(f"{path} holds a JSON {type(value).__name__}, not an object: {recover}")
    fields = {field.name: field for field in dataclasses.fields(Settings)}
    missing = [name for name, field in fields.items() if name not in value and field.default is dataclasses.MISSING
               and field.default_factory is dataclasses.MISSING]
    if missing:
        raise TeamError(f"{path} lacks {', '.join(missing)}: {recover}")
    unknown = [name for name in value if name not in fields]
    if unknown:
        raise TeamError(f"{path} holds unknown keys {', '.join(map(str, unknown))}: {recover}")
    for name, field in fields.items():
        if name in value and not _is_a(value[name], str(field.type)):
            raise TeamError(f"{path}: `{name}` is a JSON {type(value[name]).__name__}, not the {field.type} "
                            f"it must be: {recover}")
    lacking = [name for name in PORT_ENV if not 0 < value["ports"].get(name, 0) < 65536]
    if lacking:
        raise TeamError(f"{path}: `ports` has no valid port for {', '.join(lacking)}: {recover}")


def _is_a(value: object, annotation: str) -> bool:
    """Whether a JSON value fits a Settings field's annotation: `str`, `int`, or `dict[str, str|int]`."""
    def scalar(item: object, name: str) -> bool:
        return isinstance(item, str) if name == "str" else isinstance(item, int) and not isinstance(item, bool)

    if annotation.startswith("dict[str,"):
        kind = annotation.removeprefix("dict[str,").rstrip("]").strip()
        return isinstance(value, dict) and all(scalar(item, kind) for item in value.values())
    return scalar(value, annotation)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m team", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "remote", "issue"])
    parser.add_argument("name", nargs="?", help="issue: the host or person the certificate is for (its file names)")
    parser.add_argument("--state", type=Path, default=None,
                        help="the backend's state folder (default: GAT_TEAM_DIR, else .team at the repo root)")
    parser.add_argument("--no-dvc-remote", action="store_true",
                        help="up: leave this clone's DVC remote alone (the tests' backends)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="remote: the DVC repository (default: here)")
    parser.add_argument("--out", type=Path, default=None,
                        help="issue: the bundle's folder (default: <state>/issued/NAME)")
    parser.add_argument("--days", type=int, default=365, help="issue: how long the certificate is valid (default 365)")
    parser.add_argument("--colleague", action="store_true",
                        help="issue: add a colleague's client settings (the MLflow server, its login, the DVC remote)")
    args = parser.parse_args()
    if args.command == "issue" and not (args.name and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", args.name)):
        parser.error("issue needs a NAME of letters, digits, '.', '_' or '-' (a host or a person)")
    if args.command == "issue" and args.days < 1:
        parser.error("--days must be at least 1")
    state = State(args.state or default_state())
    try:
        if args.command != "remote":
            check_settings(state)
        if args.command == "up":
            up(state, dvc_remote=not args.no_dvc_remote)
        elif args.command == "down":
            down(state)
        elif args.command == "status":
            return 0 if status(state) else 3
        elif args.command == "issue":
            issue_for(state, args.name, args.out or state.root / "issued" / args.name, args.days, args.colleague)
        else:
            configure_dvc_remote(args.repo, dict(os.environ))
    except TeamError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted: whatever had started was stopped again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
