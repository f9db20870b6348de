"""Several machines, for real: the README's "Across hosts" recipe, as written, on six hosts made of network namespaces.

The topology (tests/netns_support.py: one bridge, 10.231.0.0/24; each host has its own loopback):

    server     10.231.0.10  `make team-up`: PostgreSQL (its 127.0.0.1 only), SeaweedFS's S3 API and the MLflow server
                            (HTTPS, the team CA's certificate); the data mirror the pipeline downloads from
    scheduler  10.231.0.11  `dask scheduler --protocol tls`
    worker1    10.231.0.12  `dask worker tls://...`
    worker2    10.231.0.13  `dask worker tls://...`
    alice      10.231.0.14  a colleague: clones, runs the pipeline against the server, pushes, runs an experiment on
                            the cluster and pushes it
    bob        10.231.0.15  a colleague: clones, pulls, gets "up to date", pulls Alice's experiment

Each host works in a folder of its own (`<base>/<host>/`): nothing passes between them but the network and git (a bare
repository, the group's git remote), except the bundles `python -m team issue` makes on the server host, which the
test hands to each host as an admin would (scp, a USB key). The README's `*.example.org` names are the only text
replaced, by the hosts' addresses (and `<the group's git remote>` by the bare repository's path).

The module's fixture runs the recipe once (a few minutes: the backend's start, the tiny pipeline for Cora, the pushes,
the pulls); the tests read what it left, and probe the hosts: refused connections, a worker's link cut mid-run, the
server unreachable, a colleague's wrong CA or expired certificate. At the end every process in the namespaces is
stopped and the namespaces deleted; whatever is left fails the module (netns_support). Without CAP_NET_ADMIN these
tests skip and say why, unless GAT_REQUIRE_NETNS=1 (CI's `.ci/run`), where they fail.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
from netns_support import Host, Network, network, require_netns
from pipeline_support import TINY, VENV_BIN, clean_env, copy_project, set_params
from readme_support import STAGE_S, ReadmeShell, as_if_make_made_the_venv, bash_blocks, readme_section

from team.settings import State
from team.tls import KeyPair, issue, make_ca

HEADING = "### Across hosts: TLS on every hop"
SECTION = "## Team mode: one MLflow server, one object store, shared experiments"
REMOTE = "<the group's git remote>"
HOSTS = ["server", "scheduler", "worker1", "worker2", "alice", "bob"]
NAMES = {"team.example.org": "server", "scheduler.example.org": "scheduler"}
STEPS = {"The server host": ["server"], "The scheduler host": ["scheduler"], "Each worker host": ["worker1", "worker2"],
         "Alice's host": ["alice"], "Bob's host": ["bob"]}
MIRROR_PORT = 8000
START_S = 120.0
# Cora only; 4 seeds, one per batch, each long enough (patience = max_epochs: exactly that many epochs, about 2 s on
# the Intel Xeon at 183478d) that Dask spreads the batches over both worker hosts (a batch of milliseconds stays with
# the worker that holds the graph) and that a link can be cut while one trains. 600 epochs (0.8 s there, once the
# kernel's arrays sat on cache lines) was too short: in one CI run every batch stayed on one worker host.
PARAMS = TINY | {"datasets": ["cora"], "reproduce.seeds": 4, "reproduce.seeds_per_batch": 1,
                 "reproduce.protocol.cora.optim.max_epochs": 1500, "reproduce.protocol.cora.optim.patience": 1500}


def recipe() -> list[tuple[str, list[str]]]:
    """The numbered steps of the README's "Across hosts" subsection: whose host, and the commands of its bash block."""
    section = readme_section(SECTION)
    section = section[section.index(f"\n{HEADING}\n"):]
    steps = re.findall(r"^\d+\. \*\*(.+?)\*\*(.*?)(?=^\S|\Z)", section, re.M | re.S)
    return [(who, block) for who, text in steps for block in bash_blocks(text)]


@dataclass
class Team:
    """The six hosts after the recipe: their shells, what each command said, and the server's backend."""

    net: Network
    base: Path
    replace: dict[str, str]
    shells: dict[str, ReadmeShell] = field(default_factory=dict)
    said: list[tuple[str, str, subprocess.CompletedProcess]] = field(default_factory=list)  # host, command, result
    local_seeds: bytes = b""

    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    def new_shell(self, name: str) -> ReadmeShell:
        """A terminal on host `name`, in its folder: the README's commands with the hosts' addresses for its names."""
        env = clean_env()
        if name == "alice":  # the data's download site: a mirror on the server host
            env["GAT_DATA_MIRROR"] = f"http://{self.host('server').address}:{MIRROR_PORT}"
        self.shells[name] = ReadmeShell(self.base / name, env, self.base / "logs" / name / str(len(self.shells)),
                                        self.replace, wrap=self.host(name).argv([]))
        self.shells[name].folder.mkdir(parents=True)
        return self.shells[name]

    @property
    def state(self) -> State:
        return State(self.base / "server/gat-repro/.team")

    @property
    def scheduler(self) -> str:
        return f"tls://{self.host('scheduler').address}:8786"

    def bundle(self, name: str) -> Path:
        return self.base / name / "bundle"

    def python(self, name: str, code: str, env: dict[str, str] | None = None, bundle: bool = True,
               timeout: float = START_S) -> subprocess.CompletedProcess:
        """`code` run by the venv's python on host `name`, from its folder, its bundle's team.env sourced."""
        source = f"source {self.bundle(name)}/team.env && " if bundle else ""
        return self.host(name).run(["bash", "-c", f"{source}exec {VENV_BIN / 'python'} -"], input=textwrap.dedent(code),
                                   cwd=self.base / name, env=clean_env() | (env or {}), timeout=timeout)

    def json(self, name: str, code: str, **kwargs: Any) -> Any:
        done = self.python(name, code, **kwargs)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def wait_for_workers(self, count: int = 2) -> list[str]:
        return self.json("alice", f"""
            import json
            from distributed import Client
            with Client({self.scheduler!r}, timeout=60, set_as_default=False) as client:
                client.wait_for_workers({count}, timeout={START_S})
                print(json.dumps(sorted(client.scheduler_info()["workers"])))
            """)


def _handed_over(team: Team, name: str) -> None:
    """The admin hands `.team/issued/<name>/` to host `name` (out of band, as with scp): into `<base>/<name>/bundle`."""
    shutil.copytree(team.state.root / "issued" / name, team.bundle(name))


def _origin(base: Path, planetoid_folder) -> Path:
    """The group's git remote: a bare repository holding the project at the tests' params."""
    seed, origin = base / "seed", base / "origin.git"
    copy_project(seed, planetoid_folder)
    set_params(seed, **PARAMS)
    env = clean_env()
    for command in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "the project"],
                    ["git", "init", "-q", "--bare", "-b", "main", str(origin)],
                    ["git", "push", "-q", str(origin), "main"]):
        subprocess.run(command, cwd=seed, env=env, check=True, capture_output=True)
    shutil.rmtree(seed)
    return origin


def _run_step(team: Team, who: str, commands: list[str]) -> None:
    for command in commands:
        shell = team.shells[who]
        done = shell.run(command, timeout=STAGE_S * 3)
        if done is not None:
            assert "Traceback" not in done.stdout + done.stderr, f"{who}: {command}\n{done.stdout}\n{done.stderr}"
            team.said.append((who, command, done))
        if command.startswith("git clone"):
            as_if_make_made_the_venv(team.base / who / "gat-repro")
        if command == "make team-repro":
            team.local_seeds = (team.base / who / "gat-repro/data/reproduce/cora/seeds.csv").read_bytes()


@pytest.fixture(scope="module")
def team_hosts(planetoid_folder) -> Iterator[Team]:
    require_netns()
    # Not under pytest's tmp_path (0700): PostgreSQL runs as another user, who must reach the server's clone.
    base = Path(tempfile.mkdtemp(prefix="gat-multihost-"))
    base.chmod(0o755)
    try:
        with network(HOSTS) as net:
            origin = _origin(base, planetoid_folder)
            addresses = {name: net.hosts[host].address for name, host in NAMES.items()}
            team = Team(net, base, addresses | {REMOTE: str(origin)})
            for name in HOSTS:
                (base / name).mkdir(mode=0o755)
                if name not in ("alice", "bob"):  # the colleagues clone as the recipe says
                    subprocess.run(["git", "clone", "-q", str(origin), str(base / name / "gat-repro")], env=clean_env(),
                                   check=True, capture_output=True)
                    as_if_make_made_the_venv(base / name / "gat-repro")
                team.new_shell(name)
            net.hosts["server"].popen([str(VENV_BIN / "python"), "-m", "http.server", "--bind",
                                       net.hosts["server"].address, str(MIRROR_PORT), "--directory",
                                       str(planetoid_folder.path)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            try:
                for label, commands in recipe():
                    for who in STEPS[label]:
                        _run_step(team, who, commands)
                        if who == "server":
                            for name in HOSTS[1:]:
                                _handed_over(team, name)
                        if who == "worker2":
                            team.wait_for_workers(2)
                yield team
            finally:
                for name in reversed(HOSTS):
                    team.shells[name].stop()
                team.host("server").run(["bash", "-c", "cd gat-repro && make team-down"], cwd=base / "server",
                                        env=clean_env(), timeout=120)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the recipe

def _server_runs(team: Team, experiment: str) -> list[dict[str, Any]]:
    """The runs of `experiment` on the team's server, read from Alice's host: id, status and tags."""
    return team.json("alice", f"""
        import json
        from mlflow.tracking import MlflowClient
        client = MlflowClient()
        found = client.get_experiment_by_name({experiment!r})
        runs = client.search_runs([found.experiment_id], max_results=1000) if found else []
        print(json.dumps([{{"id": r.info.run_id, "status": r.info.status, "tags": r.data.tags}} for r in runs]))
        """)


def test_the_readme_recipe_runs_on_six_hosts(team_hosts: Team) -> None:
    """The server host's backend over HTTPS, a TLS-only Dask cluster on three more hosts, Alice's pipeline run against
    the server, pushed, then its seeds again on both worker hosts as a DVC experiment, pushed; Bob pulls both and has
    nothing to rerun. The cluster's seeds.csv is the bytes of Alice's local run."""
    team = team_hosts
    steps = recipe()
    assert [who for who, _ in steps] == list(STEPS), steps
    settings = team.state.load()
    assert settings is not None and settings.host == team.host("server").address
    assert settings.tracking_uri.startswith(f"https://{team.host('server').address}:")
    statuses = [done.stdout for who, command, done in team.said if who == "bob" and command.startswith("dvc status")]
    assert len(statuses) == 2 and all("Data and pipelines are up to date." in text for text in statuses), statuses
    seeds = "data/reproduce/cora/seeds.csv"
    assert team.local_seeds and (team.base / "bob/gat-repro" / seeds).read_bytes() == team.local_seeds
    assert (team.base / "alice/gat-repro" / seeds).read_bytes() == team.local_seeds
    print(f"seeds.csv on two worker hosts, pulled on a third: sha256 {hashlib.sha256(team.local_seeds).hexdigest()}")
    applied = (team.base / "bob/gat-repro/params.yaml").read_text()
    assert re.search(r"^\s+executor: dask", applied, re.M), "Bob's workspace is not Alice's experiment"
    # The experiment's seeds ran on both worker hosts, over TLS; the first run's locally, on Alice's host.
    runs = _server_runs(team, "gat-repro-reproduce")
    parents = {run["id"]: run for run in runs if "mlflow.parentRunId" not in run["tags"]}
    (on_cluster,) = [run for run in parents.values() if run["tags"].get("dvc_exp_name") == "on-the-cluster"]
    assert on_cluster["tags"]["executor"] == "dask" and on_cluster["tags"]["dask_scheduler"] == team.scheduler
    children = [run for run in runs if run["tags"].get("mlflow.parentRunId") == on_cluster["id"]]
    hosts = {run["tags"]["worker_address"].split("//")[1].split(":")[0] for run in children}
    assert hosts == {team.host("worker1").address, team.host("worker2").address}, hosts
    assert all(run["tags"]["worker_address"].startswith("tls://") for run in children)
    # (Other tests of this module fail runs on purpose: only the recipe's are checked.)
    assert {run["status"] for run in [on_cluster, *children]} == {"FINISHED"}
    # Every stage of Alice's `make team-repro` logged to the server; none wrote a local store.
    (repro,) = [done for who, command, done in team.said if (who, command) == ("alice", "make team-repro")]
    assert {"train", "evaluate", "reproduce@cora", "report"} <= {
        line.split("'")[1] for line in repro.stdout.splitlines() if line.startswith("Running stage")}
    assert not (team.base / "alice/gat-repro/mlflow.db").exists()


# ----------------------------------------------------------------------------------------------- refusals

def _foreign_bundle(folder: Path, name: str) -> KeyPair:
    """A CA that is not the team's, and a certificate of it for `name`, in `folder`; returns the CA."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca("someone else's CA")
    ca.write(folder / "ca.key", folder / "ca.crt")
    issue(ca, name, [name]).write(folder / f"{name}.key", folder / f"{name}.crt")
    return ca


def test_plain_and_foreign_connections_from_another_host_are_refused(team_hosts: Team) -> None:
    """From Bob's host: plain HTTP to the MLflow server or the S3 API gets no answer with data; HTTPS without the team's
    CA fails TLS's check; PostgreSQL takes no connection. The scheduler refuses a `tcp://` connection and a client or a
    worker whose certificate another CA signed; Bob's own bundle gets in (so the probe can tell)."""
    team = team_hosts
    settings = team.state.load()
    assert settings is not None
    foreign = team.base / "bob/foreign"
    _foreign_bundle(foreign, "mallory")
    server = team.host("server").address
    said = team.json("bob", f"""
        import asyncio, json, os, socket
        import requests
        from distributed.comm import connect
        from distributed.security import Security

        def http(url, **options):
            try:
                answer = requests.get(url, timeout=5, **options)
                return f"HTTP {{answer.status_code}} {{answer.text[:60]}}"
            except requests.exceptions.SSLError:
                return "TLS refused"
            except requests.RequestException as error:
                return f"no answer ({{type(error).__name__}})"

        out = {{}}
        for name, url in (("mlflow", os.environ["MLFLOW_TRACKING_URI"]), ("s3", os.environ["GAT_TEAM_S3_ENDPOINT"])):
            out[name + " plain"] = http(url.replace("https://", "http://") + "/")
            out[name + " system CAs"] = http(url + "/")
            out[name + " team CA"] = http(url + "/", verify=os.environ["GAT_TEAM_CA_FILE"])
        with socket.socket() as probe:
            probe.settimeout(5)
            out["postgres"] = probe.connect_ex(({server!r}, {settings.ports["postgres"]}))

        async def dask(address, **security):
            try:
                comm = await connect(address, timeout=10, **Security(**security).get_connection_args("client"))
                await comm.close()
                return "connected"
            except Exception as error:
                return f"refused ({{type(error).__name__}})"

        scheduler = {team.scheduler!r}
        team_ca = os.environ["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"]
        out["dask tcp"] = asyncio.run(dask(scheduler.replace("tls://", "tcp://"), require_encryption=False))
        out["dask foreign cert"] = asyncio.run(dask(scheduler, tls_ca_file=team_ca,
                                                    tls_client_cert={str(foreign / "mallory.crt")!r},
                                                    tls_client_key={str(foreign / "mallory.key")!r}))
        out["dask bundle"] = asyncio.run(dask(scheduler))
        print(json.dumps(out))
        """)
    assert said["mlflow team CA"].startswith("HTTP 401"), said  # answered, and asks for a login
    assert said["s3 team CA"].startswith("HTTP 403"), said  # answered, and wants a signature
    for name in ("mlflow", "s3"):
        assert said[f"{name} system CAs"] == "TLS refused", said
        plain = said[f"{name} plain"]
        assert plain.startswith(("no answer", "HTTP 400 Client sent an HTTP request to an HTTPS")), said
    assert said["postgres"] != 0, said  # ECONNREFUSED: it listens on the server host's loopback only
    assert said["dask bundle"] == "connected", said
    assert said["dask tcp"].startswith("refused") and said["dask foreign cert"].startswith("refused"), said
    # A worker with a foreign certificate never joins: the cluster keeps its two.
    worker = team.host("bob").popen(["bash", "-c", f"exec {VENV_BIN / 'dask'} worker {team.scheduler} --nthreads 1 "
                                     f"--no-dashboard --tls-ca-file {team.bundle('bob')}/ca.crt "
                                     f"--tls-cert {foreign}/mallory.crt --tls-key {foreign}/mallory.key"],
                                    env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            _, err = worker.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            _, err = worker.communicate(timeout=20)
        assert len(team.wait_for_workers(2)) == 2
        assert "SSL" in err or "certificate" in err or "Timed out" in err, err[-2000:]
    finally:
        worker.kill()
        worker.wait(timeout=20)


# -------------------------------------------------------------------------------------------------- faults

def _alice_copy(team: Team, name: str, **params: object) -> Path:
    """A private copy of Alice's clone for one test, with `params`."""
    copy = team.base / "alice" / name
    shutil.copytree(team.base / "alice/gat-repro", copy, symlinks=True)
    set_params(copy, **params)
    return copy


def _reproduce_in(team: Team, copy: Path, out: Path, env: dict[str, str] | None = None,
                  timeout: float = STAGE_S) -> subprocess.CompletedProcess:
    """reproduce@cora by hand in `copy` on Alice's host, her bundle sourced, writing to `out`."""
    command = (f"source {team.bundle('alice')}/team.env && cd {copy} && exec {VENV_BIN / 'python'} -m stages.reproduce "
               f"--dataset cora --data data/prepared/cora --out {out}")
    return team.host("alice").run(["bash", "-c", command], env=clean_env() | (env or {}), timeout=timeout)


def _one_line(done: subprocess.CompletedProcess, out: Path) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not out.exists()
    return errors[0]


def _training(host: Host) -> Any:
    """A function that says whether a process on `host` has used 0.3 s of CPU since this call: a worker training."""
    processes = [psutil.Process(pid) for pid in host.pids()]
    start = {process.pid: sum(process.cpu_times()[:2]) for process in processes}

    def busy() -> bool:
        for process in processes:
            try:
                if sum(process.cpu_times()[:2]) - start[process.pid] > 0.3:
                    return True
            except psutil.Error:
                continue
        return False

    return busy


def test_a_worker_hosts_link_cut_mid_run_changes_nothing(team_hosts: Team) -> None:
    """`ip link set ... down` on worker2's link while it trains a batch: the scheduler gives up on it after WORKER_TTL,
    its batches run on worker1, and seeds.csv is the bytes of Alice's local run of the same params."""
    team = team_hosts
    copy = _alice_copy(team, "cut", **{"reproduce.executor": "dask"})
    worker2 = team.host("worker2")
    busy = _training(worker2)
    command = (f"source {team.bundle('alice')}/team.env && cd {copy} && exec {VENV_BIN / 'python'} -m stages.reproduce "
               f"--dataset cora --data data/prepared/cora --out {copy / 'dask'}")
    stage = team.host("alice").popen(["bash", "-c", command],
                                     env=clean_env() | {"DASK_SCHEDULER_ADDRESS": team.scheduler},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + STAGE_S
        while not busy() and stage.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stage.poll() is None, "the run ended before worker2 trained a batch"
        worker2.cut()
        _, err = stage.communicate(timeout=STAGE_S)
        assert stage.returncode == 0, err
    finally:
        worker2.restore()
        if stage.poll() is None:
            stage.kill()
            stage.wait(timeout=20)
    assert (copy / "dask/seeds.csv").read_bytes() == team.local_seeds
    # worker2 is gone from the cluster: start it again, as the README says, for the tests that follow.
    team.shells["worker2"].stop()
    (block,) = [commands for who, commands in recipe() if who == "Each worker host"]
    shell = team.new_shell("worker2")
    for command in block:
        shell.run(command)
    team.wait_for_workers(2)


def test_the_server_host_unreachable_is_one_line_within_seconds(team_hosts: Team) -> None:
    """The server host's link down: a stage on Alice's host stops before any work, in one line naming the server, exit
    2 (at most 5 s to connect; the test's deadline is 60 s)."""
    team = team_hosts
    copy = _alice_copy(team, "unreachable")
    team.host("server").cut()
    try:
        started = time.monotonic()
        done = _reproduce_in(team, copy, copy / "out", timeout=60)
        took = time.monotonic() - started
    finally:
        team.host("server").restore()
    line = _one_line(done, copy / "out")
    settings = team.state.load()
    assert settings is not None
    assert line.startswith(f"error: the MLflow tracking server at {settings.tracking_uri} is unreachable"), line
    print(f"the server host unreachable: one line after {took:.1f} s")


def test_a_wrong_ca_or_an_expired_certificate_is_one_line_naming_it(team_hosts: Team) -> None:
    """A colleague whose MLFLOW_TRACKING_SERVER_CERT_PATH is another CA, and one whose Dask certificate expired: each
    stage stops in one line naming the certificate problem, exit 2, nothing written."""
    team = team_hosts
    copy = _alice_copy(team, "certificates")
    foreign = team.base / "alice/foreign"
    _foreign_bundle(foreign, "alice")
    # team.env sets the CA: the wrong one is exported after it.
    command = (f"source {team.bundle('alice')}/team.env && export MLFLOW_TRACKING_SERVER_CERT_PATH={foreign}/ca.crt "
               f"&& cd {copy} && exec {VENV_BIN / 'python'} -m stages.reproduce --dataset cora "
               f"--data data/prepared/cora --out {copy / 'out'}")
    line = _one_line(team.host("alice").run(["bash", "-c", command], env=clean_env(), timeout=STAGE_S), copy / "out")
    assert "has a TLS certificate that the CA in MLFLOW_TRACKING_SERVER_CERT_PATH" in line, line
    assert "does not vouch for (unable to get local issuer certificate)" in line, line

    state = team.state
    ca = KeyPair(state.ca_key.read_text(), state.ca_file.read_text())
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    issue(ca, "alice", ["alice"], days=1, valid_from=past).write(foreign / "expired.key", foreign / "expired.crt")
    set_params(copy, **{"reproduce.executor": "dask"})
    command = (f"source {team.bundle('alice')}/team.env && export DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT="
               f"{foreign}/expired.crt DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY={foreign}/expired.key "
               f"DASK_SCHEDULER_ADDRESS={team.scheduler} && cd {copy} && exec {VENV_BIN / 'python'} "
               f"-m stages.reproduce --dataset cora --data data/prepared/cora --out {copy / 'out'}")
    line = _one_line(team.host("alice").run(["bash", "-c", command], env=clean_env(), timeout=STAGE_S), copy / "out")
    expired_on = (past + datetime.timedelta(days=1)).strftime("%Y-%m-%d")
    assert line.startswith(f"error: this client's Dask certificate {foreign}/expired.crt expired on {expired_on}"), line
    assert f"the scheduler at {team.scheduler} would refuse it" in line, line
