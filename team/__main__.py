"""`python -m team up|down|status|remote`: see team.backend."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from team.backend import State, TeamError, configure_dvc_remote, default_state, down, status, up


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m team", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "remote"])
    parser.add_argument("--state", type=Path, default=None,
                        help="the backend's state folder (default: GAT_TEAM_DIR, else .team at the repo root)")
    parser.add_argument("--no-dvc-remote", action="store_true",
                        help="up: leave this clone's DVC remote alone (the tests' backends)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="remote: the DVC repository (default: here)")
    args = parser.parse_args()
    state = State(args.state or default_state())
    try:
        if args.command == "up":
            up(state, dvc_remote=not args.no_dvc_remote)
        elif args.command == "down":
            down(state)
        elif args.command == "status":
            return 0 if status(state) else 3
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
