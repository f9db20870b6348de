"""Serve a dataset's champion (`models:/gat-<dataset>@champion`) over HTTP on 127.0.0.1, until Ctrl-C.

    python -m tools.serve [--dataset cora] [--port N]

The champion's files are downloaded and checked against the SHA-256 the pipeline registered
(stages.support.champion.download_verified_model), then those very files are served by
`mlflow models serve --env-manager local` (this venv's packages; its `uvicorn` on PATH). The address is printed
once the server answers /ping. Ctrl-C, SIGTERM, SIGHUP or the death of the parent (make) stop the server and its
workers within seconds; a SIGKILL of this process stops them too (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from stages.support.interrupts import main
from stages.support.params import ArgumentParser, fail
from stages.support.store import model_name, shown_uri, tracking_uri

HOST = "127.0.0.1"
# Loading the model (torch, the graph) and starting uvicorn: seconds; minutes on a busy 2-core machine.
START_TIMEOUT_S = 180.0
# How long the server gets to stop on SIGTERM before its process group is killed.
STOP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A port no one listens on now, on 127.0.0.1 (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def check_port(port: int) -> None:
    """One line and exit 2 when `port` on 127.0.0.1 is taken (or not a port), before the model is downloaded."""
    if not 1 <= port <= 65535:
        fail(f"PORT={port} is not a TCP port: give one from 1 to 65535, or leave PORT unset for a free one")
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError as error:
            fail(f"port {port} on {HOST} is taken ({error.strerror}): give another with PORT=..., or leave PORT "
                 "unset for a free one")


def _die_with_this_process() -> None:
    """In the server's process, before it runs: the kernel sends it SIGTERM when this process dies, even by
    SIGKILL (MLflow's CLI passes the same on to its uvicorn)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:  # not Linux: the stop in run()'s finally is the only one
        pass


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # refused while it starts, or a timeout
        return False


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the mlflow CLI and its uvicorn), SIGKILL after STOP_TIMEOUT_S; returns
    once the whole group is gone (the CLI can exit before its uvicorn has finished stopping)."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while group_alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not group_alive(server):
            break
    server.wait()


def group_alive(server: subprocess.Popen) -> bool:
    """Whether any process of the server's group still runs (its leader, once exited, is reaped here)."""
    server.poll()
    try:
        os.killpg(server.pid, 0)
    except ProcessLookupError:
        return False
    return True


def champion_of(dataset: str, folder: Path):
    """The champion's registered version and its verified local files, or one line naming what to run."""
    from mlflow.exceptions import MlflowException

    from stages.support.champion import CHAMPION, download_verified_model
    from stages.support.store import use_store

    name, uri = model_name(dataset), tracking_uri()
    database = uri.removeprefix("sqlite:///")
    if uri.startswith("sqlite:///") and not Path(database).is_file():  # use_store() would create an empty one
        fail(f"there is no MLflow store at {database} yet, so no {name}@{CHAMPION} to serve: run `make repro` first")
    use_store()
    try:
        return download_verified_model(f"models:/{name}@{CHAMPION}", folder)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        fail(f"{shown_uri()} has no {name}@{CHAMPION} yet (evaluate registers it): run `make repro` first, or "
             f"`dvc repro evaluate` with train.dataset: {dataset}")


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", default="cora", help="serve gat-<dataset>@champion (default: cora)")
    parser.add_argument("--port", type=int, help="the port on 127.0.0.1 (default: a free one)")
    args = parser.parse_args()
    # No progress bar on stderr for each file downloaded (here, and by the mlflow CLI, which copies the model again).
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if args.port is not None:
        check_port(args.port)
    with tempfile.TemporaryDirectory(prefix="gat-serve-") as folder:
        version, local = champion_of(args.dataset, Path(folder))
        port = args.port if args.port is not None else free_port()
        bin_folder = str(Path(sys.executable).parent)
        # The venv first on PATH: MLflow starts `uvicorn` by name (exit 127 inside a traceback without it).
        env = os.environ | {"PATH": f"{bin_folder}{os.pathsep}{os.environ.get('PATH', '')}"}
        command = [str(Path(bin_folder) / "mlflow"), "models", "serve", "-m", str(local), "--env-manager", "local",
                   "--host", HOST, "--port", str(port)]
        # A session of its own: Ctrl-C reaches this process alone, which stops the server's whole group.
        server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                  preexec_fn=_die_with_this_process)
        try:
            base = f"http://{HOST}:{port}"
            deadline = time.monotonic() + START_TIMEOUT_S
            while not answers(f"{base}/ping"):
                if server.poll() is not None:
                    fail(f"the model server exited with code {server.returncode} before it answered (its output "
                         "is above)")
                if time.monotonic() > deadline:
                    fail(f"the model server did not answer {base}/ping within {START_TIMEOUT_S:.0f} s")
                time.sleep(0.5)
            print(f"serving {version.name} version {version.version} (@champion, val_acc "
                  f"{float(version.tags.get('val_acc', 'nan')):.4f}) at {base}/invocations; Ctrl-C stops it",
                  flush=True)
            code = server.wait()
            if code != 0:
                fail(f"the model server exited with code {code} (its output is above)")
        finally:
            stop(server)


if __name__ == "__main__":
    main(run, stopping="stopping the model server.")
