"""TLS certificates: the team's CA and bundles (team/tls.py), the checks a client makes before it connects
(stages/support/certificates.py), and the one-line errors of a stage whose server or scheduler certificate it cannot
trust, against a real HTTPS server on loopback and Dask's own TLS settings. Seconds, no backend."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import os
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import dask
import pytest
import requests
from pipeline_support import REPO, VENV_BIN, clean_env

from stages.support.certificates import certificate_problem, certificate_refused
from stages.support.params import StageError
from team.settings import Settings, State
from team.tls import BUNDLE_ENV, KeyPair, ensure_certificates, issue, issue_bundle, make_ca, names_of

NOW = datetime.datetime.now(datetime.timezone.utc)


@pytest.fixture(scope="module")
def team_ca() -> KeyPair:
    return make_ca()


def _written(pair: KeyPair, folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    pair.write(key, cert)
    return key, cert


def test_a_certificate_of_the_ca_is_accepted_and_names_its_hosts(team_ca: KeyPair, tmp_path: Path) -> None:
    _, ca = _written(team_ca, tmp_path, "ca")
    _, cert = _written(issue(team_ca, "server", ["team.example.org", "10.0.0.1"]), tmp_path, "server")
    assert certificate_problem(cert, ca) is None
    assert names_of(cert) == {"team.example.org", "10.0.0.1"}
    assert (tmp_path / "server.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("problem", ["expired", "not yet valid", "another CA", "unreadable"])
def test_what_is_wrong_with_a_certificate_is_said(team_ca: KeyPair, tmp_path: Path, problem: str) -> None:
    _, ca = _written(team_ca, tmp_path, "ca")
    if problem == "expired":
        pair = issue(team_ca, "alice", ["alice"], days=1, valid_from=NOW - datetime.timedelta(days=3))
        expected = f"expired on {(NOW - datetime.timedelta(days=2)):%Y-%m-%d}"
    elif problem == "not yet valid":
        pair = issue(team_ca, "alice", ["alice"], days=5, valid_from=NOW + datetime.timedelta(days=2))
        expected = "is not valid before"
    elif problem == "another CA":
        pair = issue(make_ca("someone else's CA"), "alice", ["alice"])
        expected = f"was not signed by the CA in {ca} (it was issued by 'CN=someone else's CA'"
    else:
        pair = KeyPair("", "not a certificate\n")
        expected = "cannot be read (ValueError"
    _, cert = _written(pair, tmp_path, "alice")
    said = certificate_problem(cert, ca)
    assert said is not None and said.startswith(expected), said


def test_the_servers_certificate_is_made_again_for_a_new_host_name(tmp_path: Path) -> None:
    """`make team-up` keeps the CA, and issues the servers' certificate again when GAT_TEAM_HOST changes."""
    state = State(tmp_path)
    ensure_certificates(state, "127.0.0.1")
    ca_before, cert_before = state.ca_file.read_bytes(), state.server_cert.read_bytes()
    ensure_certificates(state, "127.0.0.1")
    assert state.server_cert.read_bytes() == cert_before  # nothing to do
    ensure_certificates(state, "team.example.org")
    assert state.ca_file.read_bytes() == ca_before and state.server_cert.read_bytes() != cert_before
    assert names_of(state.server_cert) == {"team.example.org", "127.0.0.1", "localhost"}
    assert certificate_problem(state.server_cert, state.ca_file) is None
    assert state.ca_key.stat().st_mode & 0o777 == 0o600 and state.tls.stat().st_mode & 0o777 == 0o700


def test_a_bundle_is_a_key_a_certificate_and_an_env_that_finds_them_where_it_is(tmp_path: Path) -> None:
    """`python -m team issue NAME`: the folder can be moved; its team.env points Dask (and, for a colleague, MLflow
    and DVC) at the files beside it."""
    state = State(tmp_path / "team")
    ensure_certificates(state, "127.0.0.1")
    settings = Settings.generate()
    settings.ports = {"mlflow": 5000, "s3": 8333, "postgres": 5432}
    issue_bundle(state, "worker1", tmp_path / "issued", 30, None)
    issue_bundle(state, "alice", tmp_path / "alice", 30, state.client_env(settings))
    moved = tmp_path / "elsewhere"
    (tmp_path / "alice").rename(moved)
    shown = subprocess.run(["bash", "-c", f"source {moved}/{BUNDLE_ENV} && env"], capture_output=True, text=True,
                           check=True, env={"PATH": os.environ["PATH"]}).stdout
    values = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    assert values["DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT"] == f"{moved}/alice.crt"
    assert values["DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY"] == f"{moved}/alice.key"
    assert values["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    assert values["MLFLOW_TRACKING_SERVER_CERT_PATH"] == values["GAT_TEAM_CA_FILE"] == f"{moved}/ca.crt"
    assert values["MLFLOW_TRACKING_URI"] == "https://127.0.0.1:5000"
    assert values["MLFLOW_TRACKING_PASSWORD"] == settings.admin_password
    assert certificate_problem(moved / "alice.crt", moved / "ca.crt") is None
    worker_env = (tmp_path / "issued" / BUNDLE_ENV).read_text()
    assert "MLFLOW_" not in worker_env and settings.s3_secret_key not in worker_env  # a worker gets no logins
    assert {path.stat().st_mode & 0o777 for path in (tmp_path / "issued").iterdir()} == {0o600}


@pytest.mark.parametrize("args, said", [(["issue"], "issue needs a NAME"), (["issue", "../x"], "issue needs a NAME"),
                                        (["issue", "alice", "--days", "0"], "--days must be at least 1")])
def test_issue_refuses_a_bad_name_or_lifetime(tmp_path: Path, args: list[str], said: str) -> None:
    done = subprocess.run([str(VENV_BIN / "python"), "-m", "team", *args, "--state", str(tmp_path)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not (tmp_path / "issued").exists()


def test_issue_without_a_backend_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([str(VENV_BIN / "python"), "-m", "team", "issue", "alice", "--state", str(tmp_path)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: no team backend in {tmp_path}: run `make team-up` first"), done.stderr


# ---------------------------------------------------------------------------------- a stage and an HTTPS server

@contextlib.contextmanager
def _https_server(folder: Path, ca: KeyPair) -> Iterator[str]:
    """An HTTPS server on 127.0.0.1 with a certificate of `ca`, answering every GET with an empty JSON object."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: object) -> None:
            pass

    key, cert = _written(issue(ca, "server", ["127.0.0.1"]), folder, "server")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_server_whose_certificate_the_ca_does_not_vouch_for_is_one_line(team_ca: KeyPair, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """check_server, which every stage runs first against a server: the right CA passes; another CA, or none (the
    system's CAs), is one line naming the setting and OpenSSL's reason."""
    from stages.support.store import check_server

    _, ca = _written(team_ca, tmp_path, "ca")
    _, other = _written(make_ca("someone else's CA"), tmp_path, "other")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_INSECURE_TLS", raising=False)
    with _https_server(tmp_path, team_ca) as uri:
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(ca))
        check_server(uri)
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(other))
        with pytest.raises(StageError) as refused:
            check_server(uri)
        assert str(refused.value) == (
            f"the MLflow server at {uri} has a TLS certificate that the CA in MLFLOW_TRACKING_SERVER_CERT_PATH "
            f"({other}) does not vouch for (unable to get local issuer certificate): "
            "set MLFLOW_TRACKING_SERVER_CERT_PATH to the team's CA certificate (`source .team/env`, "
            "or your bundle's env), or ask the team's admin whether the server's certificate changed")
        monkeypatch.delenv("MLFLOW_TRACKING_SERVER_CERT_PATH")
        with pytest.raises(StageError, match=r"the system's CAs \(MLFLOW_TRACKING_SERVER_CERT_PATH is not set\)"):
            check_server(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(tmp_path / "missing.crt"))
    with pytest.raises(StageError, match="MLFLOW_TRACKING_SERVER_CERT_PATH=.*missing.crt is not a file"):
        check_server("https://127.0.0.1:1")


def test_certificate_refused_reads_openssls_reason_through_the_wrappers(team_ca: KeyPair, tmp_path: Path) -> None:
    _, other = _written(make_ca("someone else's CA"), tmp_path, "other")
    with _https_server(tmp_path, team_ca) as uri, pytest.raises(requests.exceptions.SSLError) as caught:
        requests.get(uri, verify=str(other), timeout=10)
    assert certificate_refused(caught.value) == "unable to get local issuer certificate"
    assert certificate_refused(ConnectionRefusedError("refused")) is None


# ------------------------------------------------------------------------------------------- a Dask client

@pytest.mark.parametrize("case", ["unset", "expired", "another CA"])
def test_a_tls_scheduler_with_a_bad_client_certificate_is_one_line_before_connecting(team_ca: KeyPair, tmp_path: Path,
                                                                                     case: str) -> None:
    """The stage checks its Dask certificate before it connects (a scheduler that refuses it says only that the
    connection closed): not set, expired, or of another CA, each one line naming the problem and the fix."""
    from stages.support.dask_pool import _connect

    _, ca = _written(team_ca, tmp_path, "ca")
    if case == "expired":
        pair = issue(team_ca, "alice", ["alice"], days=1, valid_from=NOW - datetime.timedelta(days=5))
    else:
        pair = issue(team_ca if case == "unset" else make_ca("someone else's CA"), "alice", ["alice"])
    key, cert = _written(pair, tmp_path, "alice")
    settings = {} if case == "unset" else {"distributed.comm.tls.ca-file": str(ca),
                                           "distributed.comm.tls.client.cert": str(cert),
                                           "distributed.comm.tls.client.key": str(key)}
    address = "tls://127.0.0.1:1"  # nothing listens: the check comes first
    with dask.config.set(settings), pytest.raises(StageError) as refused:
        _connect(address, "DASK_SCHEDULER_ADDRESS")
    said = str(refused.value)
    if case == "unset":
        assert said.startswith(f"the Dask scheduler at {address} speaks TLS, and this client has no certificate "
                               "(DASK_DISTRIBUTED__COMM__TLS__CA_FILE, "), said
    else:
        reason = "expired on" if case == "expired" else "was not signed by the CA in"
        assert said.startswith(f"this client's Dask certificate {cert} {reason}"), said
        assert f"the scheduler at {address} would refuse it" in said
    assert said.endswith("ask the team's admin for a bundle (`python -m team issue NAME` on the server host), then "
                         "`source` its team.env")
