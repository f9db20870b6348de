"""The team backend's threat model, tested against the real servers (team_support's `team_backend`).

Who: another account on the same machine (loopback reaches every port), and a colleague with an MLflow
account that only has READ. What they must not get: the objects in the store (artifacts, models, DVC data), a
way to write into it, the S3 secret, or a name the pipeline later logs to. Only two listeners take clients,
each with credentials: the S3 API (its access key) and the MLflow server (basic-auth). Every other SeaweedFS
listener (master, volume and filer, HTTP and gRPC, and the S3 gateway's gRPC) wants the backend's own TLS
client certificate, and the volume and filer servers a JWT signed with a key only the backend holds.
"""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
from pathlib import Path

import pytest
import requests
import urllib3
from pipeline_support import REPO, VENV_BIN, clean_env
from team_support import TeamBackend

from stages.support.store import COMPARE_EXPERIMENT, TRAIN_EXPERIMENT
from team.names import pipeline_names
from team.settings import ARTIFACTS_BUCKET, DVC_BUCKET

urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)

# SeaweedFS's listeners that no client may use: (port name, protocol).
INTERNAL = [("master", "http"), ("volume", "http"), ("filer", "http"), ("master_grpc", "grpc"),
            ("volume_grpc", "grpc"), ("filer_grpc", "grpc"), ("s3_grpc", "grpc")]


@pytest.fixture(scope="module")
def stored(team_backend: TeamBackend) -> str:
    """An object in the DVC bucket, put through the S3 API with the backend's key."""
    key = "security-test/model.py"
    team_backend.s3().put_object(Bucket=DVC_BUCKET, Key=key, Body=b"print('the pipeline wrote this')\n")
    return key


# ------------------------------------------------------------------------- 1. SeaweedFS's HTTP listeners

@pytest.mark.parametrize("port_name", ["master", "volume", "filer"])
def test_seaweedfs_http_ports_refuse_a_client_without_the_backends_certificate(team_backend: TeamBackend,
                                                                              stored: str, port_name: str) -> None:
    port = team_backend.settings.ports[port_name]
    for path in ("/", "/dir/assign", f"/buckets/{DVC_BUCKET}/", f"/buckets/{DVC_BUCKET}/{stored}", "/dir/status"):
        plain = requests.get(f"http://127.0.0.1:{port}{path}", timeout=10)
        assert plain.status_code == 400 and "HTTPS" in plain.text, (path, plain.status_code, plain.text[:200])
        with pytest.raises(requests.exceptions.ConnectionError):  # TLS: no client certificate, no answer
            requests.get(f"https://127.0.0.1:{port}{path}", verify=False, timeout=10)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(f"https://127.0.0.1:{port}/buckets/{DVC_BUCKET}/{stored}", verify=False, timeout=10,
                      files={"file": ("model.py", b"import os; os.system('planted')\n")})
    assert b"planted" not in team_backend.s3().get_object(Bucket=DVC_BUCKET, Key=stored)["Body"].read()


def test_even_the_backends_certificate_needs_a_signed_jwt_for_the_filer(team_backend: TeamBackend,
                                                                       stored: str) -> None:
    conf = team_backend.state.weed_conf
    cert = (str(conf / "weed.crt"), str(conf / "weed.key"))
    port = team_backend.settings.ports["filer"]
    read = requests.get(f"https://127.0.0.1:{port}/buckets/{DVC_BUCKET}/{stored}", cert=cert,
                        verify=str(conf / "ca.crt"), timeout=10)
    assert read.status_code == 401 and "jwt" in read.text, (read.status_code, read.text[:200])
    write = requests.post(f"https://127.0.0.1:{port}/buckets/{DVC_BUCKET}/{stored}", cert=cert,
                          verify=str(conf / "ca.crt"), timeout=10, files={"file": ("model.py", b"planted\n")})
    assert write.status_code == 401, (write.status_code, write.text[:200])
    assert b"planted" not in team_backend.s3().get_object(Bucket=DVC_BUCKET, Key=stored)["Body"].read()


def test_only_the_s3_api_answers_and_only_with_the_key(team_backend: TeamBackend, stored: str) -> None:
    endpoint = team_backend.settings.s3_endpoint
    for path in (f"/{DVC_BUCKET}", f"/{DVC_BUCKET}/{stored}", f"/{ARTIFACTS_BUCKET}", "/"):
        anonymous = requests.get(f"{endpoint}{path}", timeout=10)
        assert anonymous.status_code == 403, (path, anonymous.status_code)
    put = requests.put(f"{endpoint}/{DVC_BUCKET}/{stored}", data=b"planted", timeout=10)
    assert put.status_code == 403
    assert team_backend.s3().get_object(Bucket=DVC_BUCKET, Key=stored)["Body"].read().startswith(b"print(")
    # SeaweedFS's S3 gateway also serves Iceberg and Lance catalogs by default: not started.
    listening = {conn.laddr.port for conn in _listeners_of(team_backend)}
    assert listening == {team_backend.settings.ports[name] for name in
                         ("s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer",
                          "filer_grpc")}, listening


def _listeners_of(backend: TeamBackend) -> list:
    import psutil

    pid = backend.pids()["seaweedfs"]
    assert pid is not None
    return [conn for conn in psutil.Process(pid).net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN]


# ------------------------------------------------------------------------- 2. SeaweedFS's gRPC listeners

@pytest.mark.parametrize("port_name", [name for name, protocol in INTERNAL if protocol == "grpc"])
def test_seaweedfs_grpc_ports_refuse_a_client_without_the_backends_certificate(team_backend: TeamBackend,
                                                                              port_name: str) -> None:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", team_backend.settings.ports[port_name]), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with context.wrap_socket(raw) as tls:  # TLS 1.3: the refusal of a missing certificate comes on read
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if not tls.recv(1024):
                    raise ConnectionError("closed")
    with socket.create_connection(("127.0.0.1", team_backend.settings.ports[port_name]), timeout=10) as raw:
        raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # plaintext gRPC
        try:
            answer = raw.recv(1024)
        except OSError:
            answer = b""
        assert len(answer) < 4 or answer[3] != 4, answer[:40]  # no HTTP/2 SETTINGS frame: no plaintext gRPC


def _weed_shell(backend: TeamBackend, cwd: Path, *config: str) -> str:
    ports = backend.settings.ports
    weed = str(VENV_BIN / "weed")
    try:
        # -logdir: glog's files beside the test's, not in /tmp.
        done = subprocess.run([weed, f"-logdir={cwd}", *config, "shell",
                               f"-master=127.0.0.1:{ports['master']}.{ports['master_grpc']}",
                               f"-filer=127.0.0.1:{ports['filer']}.{ports['filer_grpc']}"],
                              input="s3.configure\n", cwd=cwd, env=clean_env() | {"HOME": str(cwd)},
                              capture_output=True, text=True, timeout=25)
        return done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:  # subprocess.run killed it
        return f"{expired.stdout or ''}{expired.stderr or ''}"


def test_weed_shell_without_the_backends_certificate_gets_no_secret(team_backend: TeamBackend,
                                                                    tmp_path: Path) -> None:
    secret, access = team_backend.settings.s3_secret_key, team_backend.settings.s3_access_key
    output = _weed_shell(team_backend, tmp_path)
    assert secret not in output and access not in output
    # The same command with the backend's own security.toml does reach it: the test can fail.
    assert access in _weed_shell(team_backend, tmp_path, f"-config_dir={team_backend.state.weed_conf}")


# -------------------------------------------------------------------------------------- 3. file modes

def test_team_data_and_every_secret_are_the_owners_alone(team_backend: TeamBackend, tmp_path: Path) -> None:
    state = team_backend.state
    team_backend.s3().put_object(Bucket=ARTIFACTS_BUCKET, Key="security-test/modes", Body=b"x" * 1000)
    for secret_file in (state.settings_file, state.env_file, state.s3_config, state.weed_conf / "security.toml",
                        state.weed_conf / "weed.key"):
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600, secret_file
    assert not (state.weed_conf / "ca.key").exists()
    for folder in (state.weed_dir, state.weed_conf, state.pgdata):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    data = [path for path in state.weed_dir.rglob("*") if path.suffix in (".dat", ".idx", ".ecx", ".ldb")]
    assert data, list(state.weed_dir.iterdir())
    loose = {str(path): oct(stat.S_IMODE(path.stat().st_mode)) for path in data
             if stat.S_IMODE(path.stat().st_mode) & 0o077}
    assert not loose
    folders = [path for path in state.weed_dir.rglob("*") if path.is_dir()]
    assert all(stat.S_IMODE(path.stat().st_mode) & 0o077 == 0 for path in folders), folders
    # `make team-remote` writes the S3 secret into .dvc/config.local: 0600, even over an existing 0644 file.
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config.local").write_text("")
    (tmp_path / ".dvc" / "config.local").chmod(0o644)
    done = subprocess.run([str(VENV_BIN / "python"), "-m", "team", "remote", "--repo", str(tmp_path)], cwd=REPO,
                          env=clean_env() | team_backend.client_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    local = tmp_path / ".dvc" / "config.local"
    assert team_backend.settings.s3_secret_key in local.read_text()
    assert stat.S_IMODE(local.stat().st_mode) == 0o600


# ------------------------------------------------------------------------------------ 4. squatted names

def test_a_read_only_user_cannot_take_a_name_the_pipeline_will_use(team_backend: TeamBackend) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri, admin = team_backend.settings.tracking_uri, ("admin", team_backend.settings.admin_password)
    created = requests.post(f"{uri}/api/2.0/mlflow/users/create", json={"username": "squatter",
                            "password": "squatter-pass-123"}, auth=admin, timeout=30)
    assert created.status_code == 200 or "already exists" in created.text, created.text
    experiments, models = pipeline_names(REPO)
    assert COMPARE_EXPERIMENT in experiments and "gat-citeseer" in models
    for name in experiments:  # `team up` made them all, as the admin
        found = requests.get(f"{uri}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name},
                             auth=admin, timeout=30)
        assert found.status_code == 200, name
    squatter = ("squatter", "squatter-pass-123")
    for name in models:
        taken = requests.post(f"{uri}/api/2.0/mlflow/registered-models/create", json={"name": name},
                              auth=squatter, timeout=30)
        assert taken.status_code != 200 and "RESOURCE_ALREADY_EXISTS" in taken.text, (name, taken.text)
        alias = requests.post(f"{uri}/api/2.0/mlflow/registered-models/alias", auth=squatter, timeout=30,
                              json={"name": name, "alias": "champion", "version": "1"})
        assert alias.status_code == 403, (name, alias.text)
        tagged = requests.post(f"{uri}/api/2.0/mlflow/registered-models/set-tag", auth=squatter, timeout=30,
                               json={"name": name, "key": "owner", "value": "squatter"})
        assert tagged.status_code == 403, (name, tagged.text)
    for name in experiments:
        taken = requests.post(f"{uri}/api/2.0/mlflow/experiments/create", json={"name": name}, auth=squatter,
                              timeout=30)
        assert "RESOURCE_ALREADY_EXISTS" in taken.text, (name, taken.text)
    # A name the pipeline does not own stays free for anyone: the check is about the pipeline's names.
    mine = requests.post(f"{uri}/api/2.0/mlflow/registered-models/create", json={"name": "squatter-own-model"},
                         auth=squatter, timeout=30)
    assert mine.status_code == 200 or "RESOURCE_ALREADY_EXISTS" in mine.text, mine.text
    assert MlflowClient(uri).get_experiment_by_name(TRAIN_EXPERIMENT) is not None
    with pytest.raises(MlflowException):
        MlflowClient(uri).get_model_version_by_alias("gat-citeseer", "no-such-alias")


def test_evaluate_refuses_a_champion_another_user_made(team_backend: TeamBackend, tmp_path: Path) -> None:
    """A registered model someone else created before `team up` (or for a dataset added later): its
    @champion's run is not in the pipeline's training experiment, and the stage stops in one line."""
    uri = team_backend.settings.tracking_uri
    squatter = {"MLFLOW_TRACKING_USERNAME": "squatter2", "MLFLOW_TRACKING_PASSWORD": "squatter-pass-456"}
    created = requests.post(f"{uri}/api/2.0/mlflow/users/create", json={"username": "squatter2",
                            "password": "squatter-pass-456"}, timeout=30,
                            auth=("admin", team_backend.settings.admin_password))
    assert created.status_code == 200 or "already exists" in created.text, created.text
    plant = ("import mlflow\n"
             f"mlflow.set_tracking_uri('{uri}')\n"
             "exp = mlflow.create_experiment('squatter2-playground')\n"
             "with mlflow.start_run(experiment_id=exp) as run:\n"
             "    mlflow.log_text('x', 'x.txt')\n"
             "client = mlflow.MlflowClient()\n"
             "client.create_registered_model('gat-squatted')\n"
             "v = client.create_model_version('gat-squatted', f'runs:/{run.info.run_id}/x.txt', run.info.run_id,\n"
             "                                tags={'val_acc': '0.0'})\n"
             "client.set_registered_model_alias('gat-squatted', 'champion', v.version)\n")
    env = clean_env() | {"MLFLOW_TRACKING_URI": uri,
                         "MLFLOW_TRACKING_SERVER_CERT_PATH": str(team_backend.state.ca_file)} | squatter
    done = subprocess.run([str(VENV_BIN / "python"), "-c", plant], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    refusals = {
        # As the admin: the model's MANAGE holder is another user.
        "owner": "promote_if_champion('0' * 32, 'gat-squatted', 'models:/none', 0.9)",
        # Without the right to list users (a colleague with EDIT): the champion's run is not the pipeline's.
        "champion": "refuse_a_foreign_champion(MlflowClient(), 'gat-squatted', "
                    "MlflowClient().get_model_version_by_alias('gat-squatted', 'champion'))",
        "experiment": "refuse_a_foreign_name('experiment', 'squatter2-playground', "
                      "MlflowClient().get_experiment_by_name('squatter2-playground').experiment_id)",
    }
    expected = {"owner": ("registered model gat-squatted", "managed by user 'squatter2'"),
                "champion": ("gat-squatted", "not made by this pipeline", "squatter2-playground"),
                "experiment": ("experiment squatter2-playground", "managed by user 'squatter2'")}
    for what, call in refusals.items():
        check = ("from mlflow.tracking import MlflowClient\n"
                 "from stages.support.interrupts import main\n"
                 "from stages.support.champion import refuse_a_foreign_champion, promote_if_champion\n"
                 "from stages.support.store import refuse_a_foreign_name, use_store\n"
                 f"main(lambda: (use_store(), {call}))\n")
        done = subprocess.run([str(VENV_BIN / "python"), "-c", check], cwd=REPO,
                              env=clean_env() | team_backend.mlflow_env, capture_output=True, text=True, timeout=180)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (what, done.stderr[-2000:])
        assert all(needle in lines[0] for needle in expected[what]), (what, lines[0])


def test_team_up_names_a_pipeline_name_another_user_manages(team_backend: TeamBackend) -> None:
    uri, admin = team_backend.settings.tracking_uri, ("admin", team_backend.settings.admin_password)
    created = requests.post(f"{uri}/api/2.0/mlflow/users/create", json={"username": "squatter3",
                            "password": "squatter-pass-789"}, auth=admin, timeout=30)
    assert created.status_code == 200 or "already exists" in created.text, created.text
    grant = {"username": "squatter3", "resource_type": "registered_model", "resource_id": "gat-citeseer"}
    granted = requests.post(f"{uri}/api/3.0/mlflow/users/permissions/grant", auth=admin, timeout=30,
                            json=grant | {"permission": "MANAGE"})
    assert granted.status_code == 200, granted.text
    try:
        done = team_backend.team("up", "--no-dvc-remote")
    finally:
        revoked = requests.post(f"{uri}/api/3.0/mlflow/users/permissions/revoke", auth=admin, timeout=30, json=grant)
    assert revoked.status_code == 200, revoked.text
    assert done.returncode == 0, done.stderr
    assert ("warning: the registered model gat-citeseer is managed by user 'squatter3', not by admin" in done.stdout), \
        done.stdout
    assert "already up" in done.stdout


# --------------------------------------------------------------------------- 5. a password in the URI

@pytest.mark.parametrize("reachable", [False, True])
def test_a_password_in_the_tracking_uri_is_never_printed(team_backend: TeamBackend, reachable: bool) -> None:
    if reachable:
        port = team_backend.settings.ports["mlflow"]
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    password = "uri-password-s3cr3t"
    env = clean_env() | {"MLFLOW_TRACKING_URI": f"https://admin:{password}@127.0.0.1:{port}",
                         "MLFLOW_TRACKING_SERVER_CERT_PATH": str(team_backend.state.ca_file)}
    done = subprocess.run([str(VENV_BIN / "python"), "-m", "tools.init_store"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert password not in done.stdout + done.stderr
    assert f"https://***@127.0.0.1:{port}" in lines[0]
    assert ("unreachable" if not reachable else "refused the credentials") in lines[0]


# ------------------------------------------------------------------ 1. a model is verified before it loads

def test_a_model_changed_in_the_store_is_refused_before_its_code_runs(team_pipeline, team_backend: TeamBackend,
                                                                      tmp_path: Path) -> None:
    """The champion's files carry the SHA-256 the pipeline registered (tag artifacts_sha256); a file changed
    afterwards, even by someone holding the S3 key, stops `load_verified_model` before anything is unpickled."""
    import json

    from mlflow.tracking import MlflowClient

    name = json.loads((team_pipeline.root / "data/train/run.json").read_text())["model"]
    # The champion now (other tests may have moved it), then that very version throughout.
    version = MlflowClient(team_backend.settings.tracking_uri).get_model_version_by_alias(name, "champion")
    assert version.source.startswith("models:/"), version.source
    model_id = version.source.removeprefix("models:/")
    (key,) = [key for key in team_backend.objects(ARTIFACTS_BUCKET)
              if model_id in key and key.endswith("code/gat/model.py")]
    marker = tmp_path / "planted-code-ran"
    env = clean_env() | team_backend.mlflow_env

    def loading(uri: str = f"models:/{name}/{version.version}") -> subprocess.CompletedProcess:
        load = ("from stages.support.interrupts import main\n"
                "from stages.support.champion import load_verified_model\n"
                "from stages.support.store import use_store\n"
                "def run():\n"
                "    use_store()\n"
                f"    model = load_verified_model({uri!r})\n"
                "    print('loaded', type(model).__name__)\n"
                "main(run)\n")
        return subprocess.run([str(VENV_BIN / "python"), "-c", load], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)

    done = loading(f"models:/{name}@champion")
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    # The README's check by hand gives the version's tag.
    fetched = subprocess.run([str(VENV_BIN / "mlflow"), "artifacts", "download", "-u",
                              f"models:/{name}/{version.version}", "-d", "m"], cwd=tmp_path,
                             env=env | {"MLFLOW_TRACKING_URI": team_backend.settings.tracking_uri},
                             capture_output=True, text=True, timeout=300)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    by_hand = subprocess.run(["bash", "-c", "cd m && find . -type f ! -path ./registered_model_meta -printf '%P\\n' "
                              "| LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum"], cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout.split()[0]
    assert by_hand == version.tags["artifacts_sha256"], sorted(p.name for p in (tmp_path / "m").rglob("*"))
    s3 = team_backend.s3()
    original = s3.get_object(Bucket=ARTIFACTS_BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=ARTIFACTS_BUCKET, Key=key,
                  Body=original + f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode())
    try:
        done = loading()
    finally:
        s3.put_object(Bucket=ARTIFACTS_BUCKET, Key=key, Body=original)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "is not the model the pipeline registered" in lines[0] and "artifacts_sha256" in lines[0]
    assert not marker.exists()


def test_team_up_makes_data_from_before_private_again(team_backend: TeamBackend) -> None:
    """A store made before the data was private (0644 files in 0755 folders) is the owner's alone after a start."""
    from team.processes import stop_server

    state = team_backend.state
    assert stop_server(state, "seaweedfs")
    try:
        ports = team_backend.settings.ports
        left = [path for name in ("master", "volume", "filer", "s3")
                for path in Path("/tmp").glob(f"seaweedfs-{name}-grpc-{ports[name + '_grpc']}.sock")]
        assert not left, left  # weed's gRPC sockets in /tmp go with it
        state.weed_dir.chmod(0o755)
        loose = [path for path in state.weed_dir.rglob("*.dat")]
        assert loose
        for path in loose:
            path.chmod(0o644)
    finally:
        started = team_backend.team("up", "--no-dvc-remote")
    assert started.returncode == 0, started.stdout + started.stderr
    assert stat.S_IMODE(state.weed_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in loose)


def test_seaweedfs_writes_its_own_log_files_in_the_teams_folder(team_backend: TeamBackend) -> None:
    """glog's files (weed.<host>.<user>.log.INFO.<time>.<pid>, and WARNING, ERROR) go to the team's logs folder, not
    to the temporary folder, where each `team up` left three that `team down` never removed."""
    import tempfile

    from team.backend import running

    pid = running(team_backend.state)["seaweedfs"]
    assert pid is not None
    assert list(team_backend.state.logs.glob(f"weed.*.log.INFO.*.{pid}")), sorted(team_backend.state.logs.iterdir())
    assert list(Path(tempfile.gettempdir()).glob(f"weed.*.{pid}")) == []
