"""Serve a dataset's champion (`models:/gat-<dataset>@champion`) over HTTP on 127.0.0.1, until Ctrl-C.

    python -m tools.serve [--dataset cora] [--port N]

The champion's files are downloaded and checked against the SHA-256 the pipeline registered
(stages.support.champion.download_verified_model), then those very files are served by
`mlflow models serve --env-manager local` (this venv's packages; its `uvicorn` on PATH). The address is printed
once the server answers /ping. Ctrl-C, SIGTERM, SIGHUP or the death of the parent (make) stop the server and its
workers within seconds; a SIGKILL of this process stops them too (PR_SET_PDEATHSIG). The server's process is
tools.local_server's, as `make ui`'s.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from stages.support.interrupts import main
from stages.support.params import ArgumentParser, fail
from stages.support.store import model_name, shown_uri, tracking_uri
from tools.local_server import HOST, check_port, free_port, start, stop, wait_until_answering

# Loading the model (torch, the graph) and starting uvicorn: seconds; minutes on a busy 2-core machine.
START_TIMEOUT_S = 180.0
# The hint of a PORT that is taken or no port.
PORT_HINT = "give another with PORT=..., or leave PORT unset for a free one"


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
        check_port(args.port, PORT_HINT)
    with tempfile.TemporaryDirectory(prefix="gat-serve-") as folder:
        version, local = champion_of(args.dataset, Path(folder))
        port = args.port if args.port is not None else free_port()
        bin_folder = str(Path(sys.executable).parent)
        # The venv first on PATH: MLflow starts `uvicorn` by name (exit 127 inside a traceback without it).
        env = os.environ | {"PATH": f"{bin_folder}{os.pathsep}{os.environ.get('PATH', '')}"}
        server = start([str(Path(bin_folder) / "mlflow"), "models", "serve", "-m", str(local), "--env-manager",
                        "local", "--host", HOST, "--port", str(port)], env=env)
        try:
            base = f"http://{HOST}:{port}"
            wait_until_answering(server, f"{base}/ping", "the model server", START_TIMEOUT_S,
                                 lambda: "its output is above")
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
