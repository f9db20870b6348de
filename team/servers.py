"""How each team server is set up and started: PostgreSQL (initdb, pg_ctl), SeaweedFS (`weed server -s3`, its mutual
TLS and JWT keys) and `mlflow server` with basic-auth; team.backend starts them in turn."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from team.ports import listen_address
from team.processes import spawn, wait_ready
from team.settings import (ADMIN_USER, ARTIFACTS_BUCKET, DB_USER, DVC_BUCKET, JWT_SECTIONS, LOOPBACK, REGION, Settings,
                           State, TeamError, say, write_private)
from team.tls import issue, make_ca

# ---------------------------------------------------------------------------------------------- PostgreSQL

def _postgres_bin(program: str) -> str:
    found = shutil.which(program) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{program}"),
                                                      reverse=True)), None)
    if found is None:
        raise TeamError(f"`{program}` not found: install Debian's `postgresql` package "
                        "(`apt-get install postgresql`; .ci/run does)")
    return str(found)


def _postgres_account() -> pwd.struct_passwd | None:
    """Who runs PostgreSQL: this user, or, as root (which initdb and pg_ctl refuse), `postgres` or `nobody`."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise TeamError("running as root, and neither a `postgres` nor a `nobody` user exists to run PostgreSQL: "
                    "run as a normal user")


def _as_postgres(command: list[str]) -> list[str]:
    account = _postgres_account()
    return ["runuser", "-u", account.pw_name, "--", *command] if account else command


def _give_to_postgres(*paths: Path) -> None:
    account = _postgres_account()
    if account:
        for path in paths:
            os.chown(path, account.pw_uid, account.pw_gid)


def _init_postgres(state: State, settings: Settings) -> None:
    if (state.pgdata / "PG_VERSION").exists():
        return
    account = _postgres_account()
    if account and subprocess.run(["runuser", "-u", account.pw_name, "--", "test", "-x", str(state.root)]).returncode:
        raise TeamError(f"user `{account.pw_name}`, who runs PostgreSQL, cannot reach {state.root}: make its "
                        "parent folders readable (chmod o+x) or put the state elsewhere (--state, GAT_TEAM_DIR)")
    shutil.rmtree(state.pgdata, ignore_errors=True)  # a half-made cluster from an interrupted first start
    state.pgdata.mkdir(mode=0o700)
    password_file = state.root / ".pgpass.initdb"
    write_private(password_file, settings.db_password + "\n")
    _give_to_postgres(state.pgdata, password_file)
    try:
        result = subprocess.run(_as_postgres([_postgres_bin("initdb"), "-D", str(state.pgdata), "-U", DB_USER,
                                              f"--pwfile={password_file}", "--auth=scram-sha-256", "-E", "UTF8",
                                              "--no-instructions"]), capture_output=True, text=True)
    finally:
        password_file.unlink(missing_ok=True)
    if result.returncode:
        shutil.rmtree(state.pgdata, ignore_errors=True)
        raise TeamError(f"initdb failed: {result.stderr.strip().splitlines()[-1] if result.stderr else result}")
    with (state.pgdata / "postgresql.conf").open("a") as conf:
        # TCP on loopback only; no Unix socket (its default folder, /var/run/postgresql, may not be writable).
        conf.write("\n# gat-repro team backend\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n")


def start_postgres(state: State, settings: Settings) -> None:
    import psycopg2

    _init_postgres(state, settings)
    state.logs.mkdir(parents=True, exist_ok=True)
    log = state.logs / "postgres.log"
    log.touch()
    _give_to_postgres(log)
    result = subprocess.run(_as_postgres([_postgres_bin("pg_ctl"), "-D", str(state.pgdata), "-l", str(log), "-o",
                                          f"-p {settings.ports['postgres']}", "-w", "-t", "60", "start"]),
                            capture_output=True, text=True, start_new_session=True)
    if result.returncode:
        raise TeamError(f"PostgreSQL did not start on 127.0.0.1:{settings.ports['postgres']}: see {log}")
    connection = psycopg2.connect(host="127.0.0.1", port=settings.ports["postgres"], user=DB_USER,
                                  password=settings.db_password, dbname="postgres", connect_timeout=10)
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            for database in ("mlflow", "mlflow_auth"):
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
                if cursor.fetchone() is None:
                    cursor.execute(f'CREATE DATABASE "{database}"')
    finally:
        connection.close()
    say(f"PostgreSQL   127.0.0.1:{settings.ports['postgres']}  (data in {state.pgdata})")

# ----------------------------------------------------------------------------------------------- SeaweedFS

def s3_client(endpoint: str, access_key: str, secret_key: str, ca_file: Path):
    """boto3's S3 client for the team's S3 API, over HTTPS, trusting only the team's CA."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                        region_name=REGION, verify=str(ca_file),
                        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2}))


def _weed_binary() -> str:
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(weed).exists():
        raise TeamError("the `weed` binary is missing: install the pinned requirements (`make team-up` does)")
    return weed


def _make_tls(folder: Path) -> None:
    """A CA for SeaweedFS alone and one certificate it signs (server and client use, for 127.0.0.1), for its mutual
    TLS: only a process holding `weed.key` (0600, the backend's) gets an answer. The CA's key is not kept: nobody
    can sign another certificate that SeaweedFS accepts."""
    ca = make_ca("gat-repro SeaweedFS CA")
    issue(ca, "gat-weed", ["localhost", LOOPBACK]).write(folder / "weed.key", folder / "weed.crt")
    write_private(folder / "ca.crt", ca.cert_pem)


def _write_security_toml(state: State, settings: Settings) -> None:
    """SeaweedFS's own security (`weed scaffold -config=security`): every listener but the S3 API refuses a
    client without the backend's certificate (gRPC and HTTPS mutual TLS), and volume and filer requests must
    also carry a JWT signed with a key only the backend holds."""
    folder = state.weed_conf
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o700)
    if not all((folder / name).exists() for name in ("ca.crt", "weed.crt", "weed.key")):
        _make_tls(folder)
    ca, cert, key = (json.dumps(str(folder / name)) for name in ("ca.crt", "weed.crt", "weed.key"))
    lines = ["# Written by `python -m team up` (team/servers.py) at every start; mode 0600.",
             "[access]", "ui = false", "[filer.expose_directory_metadata]", "enabled = false"]
    for section in JWT_SECTIONS:
        lines += [f"[{section}]", f'key = "{settings.weed_jwt_keys[section]}"', "expires_after_seconds = 10"]
    lines += ["[grpc]", f"ca = {ca}"]
    for component in ("master", "volume", "filer", "s3", "client"):
        lines += [f"[grpc.{component}]", f"cert = {cert}", f"key = {key}"]
    lines += ["[https.client]", "enabled = true", f"cert = {cert}", f"key = {key}", f"ca = {ca}"]
    for component in ("master", "volume", "filer"):
        lines += [f"[https.{component}]", f"cert = {cert}", f"key = {key}", f"ca = {ca}"]
    write_private(folder / "security.toml", "\n".join(lines) + "\n")


def start_seaweedfs(state: State, settings: Settings) -> None:
    weed = _weed_binary()
    identities = {"identities": [{"name": "team", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                                  "credentials": [{"accessKey": settings.s3_access_key,
                                                   "secretKey": settings.s3_secret_key}]}]}
    write_private(state.s3_config, json.dumps(identities, indent=2) + "\n")
    _write_security_toml(state, settings)
    state.weed_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _make_private(state.weed_dir)  # data from before this fix: 0644 files in 0755 folders
    p = settings.ports
    process = spawn(state, "seaweedfs", [
        # Its own log files (glog's, by default in /tmp, where each start left three) beside the team's other logs.
        weed, f"-logdir={state.logs}", f"-config_dir={state.weed_conf}", "server", f"-dir={state.weed_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}", "-master.volumeSizeLimitMB=64",
        "-master.telemetry=false",  # no cluster statistics to seaweedfs.com
        # Each bucket is a collection that grows 7 volumes at once: let the volume server make as many as the
        # disk allows (0), not a fixed 8, or the second bucket finds no writable volume.
        "-volume.max=0",
        "-volume.preStopSeconds=1",  # a volume server waits 10 s before it stops, by default
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
        "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
        # The filer's and the S3 gateway's Unix sockets (by default in /tmp) go into the private data folder.
        f"-filer.localSocket={state.weed_dir / 'filer.sock'}", f"-s3.localSocket={state.weed_dir / 's3.sock'}",
        "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={state.s3_config}",
        # The S3 API alone takes clients from other hosts, on the team host's address, over HTTPS only (a plain
        # request gets HTTP 400), with the team CA's certificate.
        f"-s3.ip.bind={listen_address(settings.host)}", f"-s3.cert.file={state.server_cert}",
        f"-s3.key.file={state.server_key}",
    ], env=dict(os.environ), umask=0o077)
    client = s3_client(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key, state.ca_file)

    def buckets_made() -> bool:
        have = {bucket["Name"] for bucket in client.list_buckets()["Buckets"]}
        for bucket in (ARTIFACTS_BUCKET, DVC_BUCKET):
            if bucket not in have:
                client.create_bucket(Bucket=bucket)
        return True

    wait_ready("SeaweedFS", process, buckets_made, state.logs / "seaweedfs.log")
    say(f"SeaweedFS S3 {settings.s3_endpoint}  (buckets {ARTIFACTS_BUCKET}, {DVC_BUCKET}; data in {state.weed_dir})")


def _make_private(folder: Path) -> None:
    """Every folder under `folder` 0700 and every file 0600 (the owner's alone)."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod(0o700 if path.is_dir() else 0o600)

# ------------------------------------------------------------------------------------------- MLflow server

def _mlflow_env(state: State, settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_", "AWS_"))}
    return env | {
        "PGPASSWORD": settings.db_password,
        "MLFLOW_S3_ENDPOINT_URL": settings.s3_endpoint,
        "AWS_CA_BUNDLE": str(state.ca_file),  # the S3 API's certificate is the team CA's
        "AWS_ACCESS_KEY_ID": settings.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": settings.s3_secret_key,
        "AWS_DEFAULT_REGION": REGION,
        "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN_USER,
        "MLFLOW_AUTH_ADMIN_PASSWORD": settings.admin_password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": settings.flask_secret,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # The server's job runner (GenAI scorers, seven huey consumer processes) has nothing to do here.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }


def start_mlflow(state: State, settings: Settings) -> None:
    import requests

    mlflow = str(Path(sys.executable).parent / "mlflow")
    env = _mlflow_env(state, settings)
    upgrade = subprocess.run([mlflow, "db", "upgrade", settings.database_uri("mlflow")], env=env,
                             capture_output=True, text=True)
    if upgrade.returncode:
        raise TeamError(f"`mlflow db upgrade` failed: {(upgrade.stderr.strip().splitlines() or ['?'])[-1]}")
    state.auth_config.write_text(
        "[mlflow]\n"
        "# Every user but the admin may read everything and write nothing, until granted more.\n"
        "default_permission = READ\n"
        f"database_uri = {settings.database_uri('mlflow_auth')}\n"
        f"admin_username = {ADMIN_USER}\n"
        "# The admin's password comes from MLFLOW_AUTH_ADMIN_PASSWORD (settings.json), not from this file.\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "# Checking a password (PBKDF2) costs about as much as the request: each worker remembers a good one\n"
        "# for a minute, so a password change or a deleted user takes up to 60 s to reach every worker.\n"
        "auth_cache_ttl_seconds = 60\n")
    env["MLFLOW_AUTH_CONFIG_PATH"] = str(state.auth_config)
    port = settings.ports["mlflow"]
    process = spawn(state, "mlflow", [
        mlflow, "server", "--app-name", "basic-auth", "--host", listen_address(settings.host), "--port", str(port),
        "--workers", "2", "--backend-store-uri", settings.database_uri("mlflow"),
        "--serve-artifacts", "--artifacts-destination", f"s3://{ARTIFACTS_BUCKET}",
        # HTTPS only, with the team CA's certificate for GAT_TEAM_HOST: a plain-HTTP request gets no answer.
        "--uvicorn-opts", shlex.join(["--ssl-keyfile", str(state.server_key),
                                      "--ssl-certfile", str(state.server_cert)]),
        "--allowed-hosts", ",".join(f"{name}:{port}"
                                    for name in dict.fromkeys([settings.host, LOOPBACK, "localhost"])),
    ], env=env)

    def answers() -> bool:
        response = requests.get(f"{settings.tracking_uri}/api/2.0/mlflow/experiments/search",
                                params={"max_results": 1}, auth=(ADMIN_USER, settings.admin_password), timeout=5,
                                verify=str(state.ca_file))
        return response.status_code == 200

    wait_ready("mlflow server", process, answers, state.logs / "mlflow.log")
    say(f"MLflow       {settings.tracking_uri}  ({state.login}; runs in PostgreSQL, "
        f"artifacts in s3://{ARTIFACTS_BUCKET})")
