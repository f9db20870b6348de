"""tools/ui.py (`make ui`) and what MLflow's UI shows: the pages' addresses, the experiments' views, and the
descriptions, which the UI renders as Markdown."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from conftest import WITH_DEFAULT_SIGNALS
from markdown_it import MarkdownIt
from markdown_support import markdown_problems

from stages.support.champion import model_description
from stages.support.store import (DESCRIPTIONS, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT, VIEWS, compare_url,
                                  process_start, ui_url)
from stages.support.tracking import code_span, describe_run

ROOT = Path(__file__).resolve().parents[1]
# Bounds for the loops below (never asserted as durations): a busy 2-core machine starts MLflow in about a minute.
START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60


def test_the_markdown_check_finds_a_swallowed_tag_and_stray_emphasis() -> None:
    assert markdown_problems("registered as gat-<dataset>@champion")
    assert markdown_problems("curves epoch_*, and *all* of them")
    assert markdown_problems("keys train_optim_lr and model_heads_count") == []  # mid-word `_` stays literal
    assert markdown_problems("registered as `gat-<dataset>@champion`") == []


def test_make_uis_hint_names_a_port_to_use() -> None:
    from tools.ui import port_hint

    assert port_hint(5000).endswith("`make ui PORT=5001`") and "stop what listens there" in port_hint(5000)
    assert port_hint(70000) == port_hint(65535) == "use another port: `make ui PORT=5001`"


def test_every_description_renders_as_written() -> None:
    changed = {"train.optim.lr": "<dataset>", "train.model.heads": "a*b*c", "download.base_url": "`quoted` x_y_z"}
    texts = [*DESCRIPTIONS.values(), model_description("gat-cora"),
             describe_run("GAT trained on cora: `epoch_*` are the curves.", changed),
             describe_run("GAT trained on cora.", {})]
    for text in texts:
        assert markdown_problems(text) == [], text


@pytest.mark.parametrize("value", ["plain", "<dataset>", "a`b", "`starts", "ends`", "``", 0.005])
def test_a_code_span_shows_its_value_verbatim(value: object) -> None:
    (paragraph,) = [token for token in MarkdownIt("commonmark").parse(code_span(value)) if token.type == "inline"]
    (span,) = paragraph.children or []
    assert span.type == "code_inline" and span.content == str(value)


def test_page_addresses_keep_the_model_training_view() -> None:
    page = urlsplit(ui_url("http://127.0.0.1:5001/", "7"))
    path, _, query = page.fragment.partition("?")
    assert (page.netloc, path) == ("127.0.0.1:5001", "/experiments/7/runs")
    assert parse_qs(query) == {"workflowType": ["machine_learning"], "viewStateShareKey": ["main"]}

    charts = urlsplit(ui_url("http://127.0.0.1:5001", "7", charts=True))
    assert parse_qs(charts.fragment.partition("?")[2]) == {
        "workflowType": ["machine_learning"], "viewStateShareKey": ["main"], "compareRunsMode": ["CHART"]}

    compare = urlsplit(compare_url("http://127.0.0.1:5001", ["r1", "r2"], ["2"]))
    path, _, query = compare.fragment.partition("?")
    assert path == "/compare-runs"
    params = parse_qs(query)
    # MLflow's page reads the ids as JSON arrays; quoted, so that a terminal keeps the whole address as one link
    assert json.loads(params["runs"][0]) == ["r1", "r2"] and json.loads(params["experiments"][0]) == ["2"]
    assert params["workflowType"] == ["machine_learning"]
    assert not set('"[] ') & set(unquote(query).replace(params["runs"][0], "").replace(params["experiments"][0], ""))


def test_the_training_chart_view_opens_on_the_params_against_test_acc() -> None:
    view = VIEWS[TRAIN_EXPERIMENT]
    (chart,) = view["compareRunCharts"]
    assert chart["type"] == "PARALLEL" and chart["selectedMetrics"] == ["test_acc"]
    shown = set(view["selectedColumns"])
    assert {f"params.`{key}`" for key in chart["selectedParams"]} <= shown and "metrics.`test_acc`" in shown
    assert chart["metricSectionId"] in {section["uuid"] for section in view["compareRunSections"]}


@pytest.fixture
def tiny_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(None)  # store.connect set it for this process: no other test may log here


def test_the_reproduce_view_lists_the_parents_and_compare_lists_the_newest_of_each(tiny_store: str) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    from stages.support.store import connect
    from tools.ui import reproduced_configurations

    experiment_id = connect(REPRODUCE_EXPERIMENT)
    client = MlflowClient()
    parents = {}
    for name, exp, mean in (("cora-3-seeds", "old", 0.80), ("cora-3-seeds", "old", 0.81), ("cora-3-seeds", "lr", 0.83),
                            ("citeseer-3-seeds", "old", 0.72)):
        with mlflow.start_run(experiment_id=experiment_id, run_name=name, tags={"dvc_exp_name": exp}) as parent:
            mlflow.log_metric("test_acc_mean", mean)
            for seed in range(2):
                with mlflow.start_run(experiment_id=experiment_id, run_name=f"seed-{seed}", nested=True):
                    mlflow.log_metric("test_acc", mean)
        parents[(name, exp, mean)] = parent.info.run_id
    # The UI sends the view's filter as is: the server returns the parents only, and the footer counts them.
    found = client.search_runs([experiment_id], filter_string=VIEWS[REPRODUCE_EXPERIMENT]["searchFilter"])
    assert {run.info.run_id for run in found} == set(parents.values())
    assert reproduced_configurations(client, experiment_id) == [
        parents[key] for key in (("cora-3-seeds", "lr", 0.83), ("cora-3-seeds", "old", 0.81),
                                 ("citeseer-3-seeds", "old", 0.72))]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running, and any other process in their process groups (the server's workers start
    after it, in its group)."""
    groups = {_stat(pid)[2] for pid in pids if _stat(pid)}
    members = {int(entry.name) for entry in Path("/proc").iterdir()
               if entry.name.isdigit() and (stat := _stat(int(entry.name))) and stat[2] in groups}
    return {pid for pid in pids | members if process_start(pid) is not None}


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, ...), or [] when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def _kill(pids: set[int]) -> None:
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read_until(ui: subprocess.Popen, prefix: str) -> list[str]:
    """The lines `ui` prints, up to the first that starts with `prefix` (or its end, or START_TIMEOUT_S)."""
    assert ui.stdout is not None
    lines: list[str] = []
    received = b""
    deadline = time.monotonic() + START_TIMEOUT_S
    with selectors.DefaultSelector() as selector:  # the pipe's bytes, unbuffered: select sees each line
        selector.register(ui.stdout.fileno(), selectors.EVENT_READ)
        while not (lines and lines[-1].startswith(prefix)) and time.monotonic() < deadline:
            if selector.select(timeout=1):
                chunk = os.read(ui.stdout.fileno(), 65536)
                if not chunk:
                    break
                *done, received = (received + chunk).split(b"\n")
                lines += [line.decode() for line in done]
    return lines


def _ui(port: int, store: str) -> subprocess.Popen:
    env = dict(os.environ, MLFLOW_TRACKING_URI=store, PYTHONUNBUFFERED="1")
    return subprocess.Popen([*WITH_DEFAULT_SIGNALS, sys.executable, "-m", "tools.ui", "--port", str(port)], cwd=ROOT,
                            env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_a_taken_port_is_one_line_exit_2_and_starts_nothing(tiny_store: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ui = _ui(port, tiny_store)
        try:
            out, err = ui.communicate(timeout=START_TIMEOUT_S)
        finally:
            ui.kill()
    assert ui.returncode == 2
    assert err.splitlines() == [f"error: port {port} on 127.0.0.1 is taken (Address already in use): stop what listens "
                                f"there (another MLflow UI?), or use another port: `make ui PORT={port + 1}`"]
    assert out == ""
    assert not Path(tiny_store.removeprefix("sqlite:///")).with_name(".mlflow-ui.log").exists()  # no server


@pytest.mark.slow
def test_the_ui_prints_its_pages_once_they_answer_and_sigterm_stops_it_all(tiny_store: str) -> None:
    import requests

    port = _free_port()
    ui = _ui(port, tiny_store)
    below: set[int] = set()
    try:
        assert ui.stdout is not None
        lines = _read_until(ui, "Ctrl-C stops")
        # Asked at once: every printed page answers, and MLflow's API behind it.
        pages = [line.split(": ", 1)[1] for line in lines if line.startswith("  ")]
        assert len(pages) == 6, lines  # five experiments and the training charts: no reproduction to compare
        for page in pages:
            assert page.startswith(f"http://127.0.0.1:{port}/#/") and "workflowType=machine_learning" in page
            assert requests.get(page.partition("#")[0], timeout=30).status_code == 200
        answer = requests.get(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search",
                              params={"max_results": 10}, timeout=30)
        assert {e["name"] for e in answer.json()["experiments"]} >= {TRAIN_EXPERIMENT, REPRODUCE_EXPERIMENT}
        below = _descendants(ui.pid)
        assert below  # the server and its workers
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(STOP_TIMEOUT_S) == 128 + signal.SIGTERM
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _alive(below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(below)
        assert ui.stderr is not None and ui.stderr.read().splitlines() == [
            "error: interrupted by SIGTERM: stopping the MLflow UI."]
    finally:
        _kill(below | _descendants(ui.pid))  # first: once the UI process is gone, its server is no descendant
        ui.kill()
        ui.wait()


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, said", [(signal.SIGINT, 128 + signal.SIGINT,
                                                 ["error: interrupted by SIGINT: stopping the MLflow UI."]),
                                                # the kernel then ends the server (PR_SET_PDEATHSIG)
                                                (signal.SIGKILL, -signal.SIGKILL, [])])
def test_a_stop_while_the_ui_starts_ends_it_all(tiny_store: str, signum: int, code: int, said: list[str]) -> None:
    ui = _ui(_free_port(), tiny_store)
    below: set[int] = set()
    try:
        assert _read_until(ui, "Starting the MLflow UI")[-1].startswith("Starting the MLflow UI")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not below and time.monotonic() < deadline:  # the server process, started just after that line
            below = _descendants(ui.pid)
            time.sleep(0.05)
        assert below
        ui.send_signal(signum)
        assert ui.wait(STOP_TIMEOUT_S) == code
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _alive(below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(below)
        assert ui.stderr is not None and ui.stderr.read().splitlines() == said
    finally:
        _kill(below | _descendants(ui.pid))  # first: once the UI process is gone, its server is no descendant
        ui.kill()
        ui.wait()
