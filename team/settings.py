"""The team backend's settings and state folder: its fixed names, the generated secrets (settings.json, mode 0600),
the clients' `env` file, and the one-line TeamError every command reports."""

from __future__ import annotations

import json
import os
import secrets
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

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

# security.toml's JWT sections, each with a key of its own.
JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
LOOPBACK = "127.0.0.1"


class TeamError(Exception):
    """A problem the user can fix, said in one line."""


def say(line: str) -> None:
    print(line, flush=True)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_state() -> Path:
    return Path(os.environ.get("GAT_TEAM_DIR") or repo_root() / ".team")


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
    # The name (or address) clients reach the MLflow server and the S3 API at (GAT_TEAM_HOST): in their URLs and in
    # the servers' certificate. Both listen on the address it resolves to; PostgreSQL stays on 127.0.0.1.
    host: str = LOOPBACK

    @classmethod
    def generate(cls) -> "Settings":
        return cls(ports={}, db_password=secrets.token_urlsafe(24), admin_password=secrets.token_urlsafe(24),
                   s3_access_key="gat" + secrets.token_hex(8), s3_secret_key=secrets.token_urlsafe(30),
                   flask_secret=secrets.token_hex(32), weed_jwt_keys=new_jwt_keys())

    @property
    def tracking_uri(self) -> str:
        return f"https://{self.host}:{self.ports['mlflow']}"

    @property
    def s3_endpoint(self) -> str:
        return f"https://{self.host}:{self.ports['s3']}"

    def database_uri(self, database: str) -> str:
        # No password in the URI (it would show in `ps`): libpq takes it from PGPASSWORD.
        return f"postgresql+psycopg2://{DB_USER}@127.0.0.1:{self.ports['postgres']}/{database}"

    def client_env(self, ca_file: str) -> dict[str, str]:
        """What `.team/env` exports: the tracking server and its admin account, the team's CA certificate (MLflow's
        own setting, and the DVC remote's `ssl_verify`), the stages' request settings against a server (for the
        user's own MLflow calls too), and the DVC remote."""
        from stages.support.store import SERVER_REQUEST_SETTINGS

        return {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_TRACKING_USERNAME": ADMIN_USER,
            "MLFLOW_TRACKING_PASSWORD": self.admin_password,
            "MLFLOW_TRACKING_SERVER_CERT_PATH": ca_file,
            **SERVER_REQUEST_SETTINGS,
            "GAT_TEAM_CA_FILE": ca_file,
            "GAT_TEAM_S3_ENDPOINT": self.s3_endpoint,
            "GAT_TEAM_DVC_REMOTE": f"s3://{DVC_BUCKET}",
            "GAT_TEAM_S3_ACCESS_KEY_ID": self.s3_access_key,
            "GAT_TEAM_S3_SECRET_ACCESS_KEY": self.s3_secret_key,
        }


def new_jwt_keys() -> dict[str, str]:
    return {name: secrets.token_hex(32) for name in JWT_SECTIONS}


def write_private(path: Path, text: str) -> None:
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
        # The team's CA (its key never leaves this folder) and the MLflow server's and S3 API's certificate.
        self.tls = self.root / "tls"
        self.ca_file, self.ca_key = self.tls / "ca.crt", self.tls / "ca.key"
        self.server_cert, self.server_key = self.tls / "server.crt", self.tls / "server.key"
        self.logs = self.root / "logs"
        self.pids = self.root / "run"

    @property
    def login(self) -> str:
        """How to log in to the MLflow server's pages (a browser asks): the account, and where its password is (the
        password itself goes into no output)."""
        return f"log in as {ADMIN_USER}, password: MLFLOW_TRACKING_PASSWORD in {self.env_file}"

    def client_env(self, settings: Settings) -> dict[str, str]:
        return settings.client_env(str(self.ca_file))

    def load(self) -> Settings | None:
        if not self.settings_file.exists():
            return None
        return Settings(**json.loads(self.settings_file.read_text()))

    def save(self, settings: Settings) -> None:
        write_private(self.settings_file, json.dumps(asdict(settings), indent=2) + "\n")
        lines = [f"export {key}={shlex.quote(value)}" for key, value in self.client_env(settings).items()]
        write_private(self.env_file, "# The gat-repro team backend (`make team-up`): `source` this file, then "
                                      "`make team-repro`, `dvc push --run-cache`, `make ui`.\n"
                                      + "\n".join(lines) + "\n")
