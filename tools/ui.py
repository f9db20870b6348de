"""The MLflow UI on the project's store, and the pages to open in it.

    python -m tools.ui [--port 5000]        (make ui [PORT=5000])

Against the local store, it checks that 127.0.0.1:PORT is free, starts `mlflow ui` there (its log in
.mlflow-ui.log beside the store), waits until it answers, and only then prints the pages: each experiment's runs
table and a comparison of the reproduced configurations, all in the "Model training" view. Ctrl-C, SIGTERM or
SIGHUP stop it and its workers (tools.local_server). With a team server's settings sourced
(MLFLOW_TRACKING_URI=http://...), it prints that server's pages and starts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from stages.support.interrupts import main
from stages.support.params import ArgumentParser, fail
from stages.support.redaction import redact_urls
from stages.support.store import (EXPERIMENTS, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT, artifact_root, compare_url,
                                  connect, is_server, shown_uri, tracking_uri, ui_url)
from tools.local_server import HOST, check_port, start, stop, wait_until_answering

DEFAULT_PORT = 5000
# How long the server may take to answer: about 10 s on an idle 2-core machine, 30 s and more on a busy one.
START_TIMEOUT_S = 180.0
# Starlette 1.x deprecates the WSGI bridge that MLflow's FastAPI app imports (mlflow/server/fastapi_app.py), and
# each server process says so at import: lines that name nothing a user can act on (MLflow and Starlette are
# pinned in constraints.txt). Only that message is ignored, and only in the server's processes. Its category,
# StarletteDeprecationWarning, is a UserWarning; -W/PYTHONWARNINGS cannot name it, being read before
# site-packages is importable ("Invalid -W option ignored").
SERVER_WARNING_FILTER = "ignore:starlette.middleware.wsgi is deprecated:UserWarning"
# The most reproduced configurations one comparison address lists (the compare page draws each run).
COMPARE_MAX_RUNS = 20


def port_hint(port: int) -> str:
    """What to do when `port` is taken, or no port: the hint of tools.local_server.check_port's line."""
    if not 1 <= port < 65535:
        return f"use another port: `make ui PORT={DEFAULT_PORT + 1}`"
    return f"stop what listens there (another MLflow UI?), or use another port: `make ui PORT={port + 1}`"


def server_command(port: int, store_uri: str, artifacts: Path) -> list[str]:
    """`mlflow ui` on HOST:port, with one worker (a UI for one person needs no more, and starts sooner)."""
    return [str(Path(sys.executable).parent / "mlflow"), "ui", "--host", HOST, "--port", str(port), "--workers", "1",
            "--backend-store-uri", store_uri, "--registry-store-uri", store_uri, "--artifacts-destination",
            str(artifacts)]


def server_env() -> dict[str, str]:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    env["PYTHONWARNINGS"] = ",".join(filter(None, (env.get("PYTHONWARNINGS"), SERVER_WARNING_FILTER)))
    return env


def last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "nothing logged"


def reproduced_configurations(client: MlflowClient, experiment_id: str) -> list[str]:
    """The newest finished parent run of each reproduced configuration (run name and DVC experiment), best mean
    test accuracy first: the rows of the paper's table."""
    parents = client.search_runs([experiment_id], filter_string="attributes.status = 'FINISHED'",
                                 order_by=["attributes.start_time DESC"], max_results=1000)
    newest: dict[tuple[str, str], Run] = {}
    for run in parents:
        if "mlflow.parentRunId" in run.data.tags or "test_acc_mean" not in run.data.metrics:
            continue
        newest.setdefault((run.info.run_name or "", run.data.tags.get("dvc_exp_name", "")), run)
    best = sorted(newest.values(), key=lambda run: -run.data.metrics["test_acc_mean"])
    return [run.info.run_id for run in best[:COMPARE_MAX_RUNS]]


def pages(base: str) -> list[str]:
    """One line per page to open: each experiment's runs table, then the comparisons: the training runs' charts,
    and the reproduced configurations side by side (MLflow's Compare page, which the runs table's Compare button
    opens without `workflowType`, so in the GenAI view)."""
    ids = {name: connect(name) for name in EXPERIMENTS}
    lines = [f"  {name}: {ui_url(base, experiment_id)}" for name, experiment_id in ids.items()]
    lines.append(f"  compare the training runs (params against test_acc): {ui_url(base, ids[TRAIN_EXPERIMENT], True)}")
    reproduced = reproduced_configurations(MlflowClient(), ids[REPRODUCE_EXPERIMENT])
    if reproduced:
        lines.append(f"  compare the {len(reproduced)} reproduced configurations: "
                     f"{compare_url(base, reproduced, [ids[REPRODUCE_EXPERIMENT]])}")
    return lines


def serve(port: int) -> None:
    """Start the UI on the local store, print its pages once it answers, and run until stopped."""
    check_port(port, port_hint(port))
    lines = pages(base := f"http://{HOST}:{port}")  # also makes the store, and ends runs left RUNNING
    artifacts = artifact_root()
    log = artifacts.parent / ".mlflow-ui.log"
    process: subprocess.Popen | None = None
    try:
        print(f"Starting the MLflow UI on {base} (store {shown_uri()}; its log: {log}) ...", flush=True)
        with log.open("w") as out:
            process = start(server_command(port, tracking_uri(), artifacts), env=server_env(), output=out)
        wait_until_answering(process, f"{base}/health", "mlflow ui", START_TIMEOUT_S,
                             lambda: f"{last_line(log)} (its log: {log})")
        print("Open these pages (the \"Model training\" view, with the important columns shown):", *lines,
              "Ctrl-C stops the UI.", sep="\n", flush=True)
        code = process.wait()
        fail(f"mlflow ui stopped by itself (code {code}): {last_line(log)} (its log: {log})")
    finally:
        if process is not None:
            stop(process)


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the UI's port on {HOST} (default 5000)")
    args = parser.parse_args()
    uri = tracking_uri()
    if is_server(uri):  # a team server has its own UI: only its pages
        print("Open these pages on the team's MLflow server (the \"Model training\" view, with the important "
              "columns shown):", *pages(redact_urls(uri)), sep="\n")
    else:
        serve(args.port)


if __name__ == "__main__":
    main(run, stopping="stopping the MLflow UI.")
