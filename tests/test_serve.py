"""Serving the champion: the logged model (stages/support/served_model.py) and `make serve` (tools/serve.py).

The fast tests check the node ids and tools.serve's refusals in this process. The e2e ones train and evaluate a
tiny model on synthetic Cora with the real stage processes (once per module, into a SQLite store in a temporary
folder), then load it, and serve it with the real `python -m tools.serve` on a free loopback port.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from conftest import SYNTHETIC_LAYOUTS, WITH_DEFAULT_SIGNALS, run_stage_in_process, write_synthetic_planetoid
from pipeline_support import REPO, VENV_BIN, clean_env

from gat.data import graph_from_tensors, graph_to_tensors, parse_planetoid
from gat.datasets import file_names
from gat.model import NodeClassifier, model_from_state
from gat.training import GraphTensors
from stages.support.served_model import NodeIdError, node_ids
from tools import serve
from tools.local_server import free_port

NODES = 1140  # synthetic Cora's (SYNTHETIC_LAYOUTS): ids 0 to 1139
SENTENCE = ("node ids must be integers from 0 to {last} (Cora has {nodes} nodes), in a non-empty list; got {got}")
# The requests a user may get wrong, and what the answer names.
BAD = [([1.9], "1.9"), ([1.0], "1.0"), ([3, 2.5], "2.5"), ([-1], "-1"), ([0, 99999], "99999"), (["a"], "'a'"),
       ([], "an empty list"), ([[1, 2]], "[[1, 2]]"), ([True], "True"), (7, "7")]
START_TIMEOUT_S = 240.0  # model loading and uvicorn on a busy 2-core machine
STOP_TIMEOUT_S = 30.0


# ------------------------------------------------------------------------------------------- node ids, in-process

@pytest.mark.parametrize("given, got", BAD, ids=[str(given) for given, _ in BAD])
def test_bad_node_ids_are_one_sentence_with_the_valid_type_and_range(given: Any, got: str) -> None:
    with pytest.raises(NodeIdError) as raised:
        node_ids(given, 2708, "cora")
    assert raised.value.message == SENTENCE.format(last=2707, nodes=2708, got=got)
    assert raised.value.error_code == "INVALID_PARAMETER_VALUE"


def test_the_scoring_servers_rewrite_of_the_message_is_ignored() -> None:
    """MLflow's scoring server sets `message` to "Failed to predict data '<request>'. \\nError: <message>"."""
    error = NodeIdError("node ids must be integers")
    error.message = f"Failed to predict data '[1.9]'. \nError: {error.message}"
    assert json.loads(error.serialize_as_json())["message"] == "node ids must be integers"


@pytest.mark.parametrize("given", [[0, 5, 2707], np.array([3, 4]), torch.tensor([1]), np.array([7], np.uint8)],
                         ids=["list", "array", "tensor", "uint8"])
def test_valid_node_ids_become_int64(given: Any) -> None:
    ids = node_ids(given, 2708, "cora")
    assert ids.dtype == np.int64 and ids.tolist() == np.asarray(given).tolist()


def test_a_one_column_dataframe_is_node_ids() -> None:
    import pandas as pd

    assert node_ids(pd.DataFrame({"node": [4, 2]}), 2708, "cora").tolist() == [4, 2]


# ------------------------------------------------------------------------------- tools.serve's refusals, in-process

def _serve(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    return run_stage_in_process(monkeypatch, "tools.serve", serve.run, *args)


def test_no_store_yet_is_one_line_and_creates_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert _serve(monkeypatch) == 2
    assert capsys.readouterr().err == (f"error: there is no MLflow store at {tmp_path / 'mlflow.db'} yet, so no "
                                       "gat-cora@champion to serve: run `make repro` first\n")
    assert not (tmp_path / "mlflow.db").exists()


def test_a_store_without_a_champion_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from stages.support.store import connect

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    connect("gat-repro")  # an empty store, as tools.init_store leaves it
    capsys.readouterr()
    assert _serve(monkeypatch, "--dataset", "citeseer") == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: sqlite:///{tmp_path / 'mlflow.db'} has no gat-citeseer@champion yet (evaluate "
                        "registers it): run `make repro` first, or `dvc repro evaluate` with train.dataset: "
                        "citeseer\n"), err
    assert "Traceback" not in err


def test_a_taken_port_is_one_line_before_anything_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _serve(monkeypatch, "--port", str(port)) == 2
    assert re.fullmatch(rf"error: port {port} on 127\.0\.0\.1 is taken \([^)]+\): give another with PORT=\.\.\., "
                        r"or leave PORT unset for a free one\n", capsys.readouterr().err)
    assert not (tmp_path / "mlflow.db").exists()


# ------------------------------------------------------------------------------- a trained champion (real stages)

class Champion:
    """A folder where train and evaluate ran on synthetic Cora: data/, mlflow.db, mlartifacts/."""

    def __init__(self, root: Path, env: dict[str, str], train: subprocess.CompletedProcess):
        self.root, self.env, self.train = root, env, train

    def classifier(self) -> NodeClassifier:
        """The trained model as train saved it (data/train/model.pt), bound to the prepared graph."""
        graph = graph_from_tensors(torch.load(self.root / "data/prepared/cora/graph.pt", weights_only=True))
        tensors = GraphTensors.from_graph(graph)
        state = torch.load(self.root / "data/train/model.pt", weights_only=True)
        return NodeClassifier(model_from_state(state), tensors.x, tensors.neighbourhoods)


def _stage(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(VENV_BIN / "python"), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def champion(tmp_path_factory: pytest.TempPathFactory) -> Champion:
    root = tmp_path_factory.mktemp("champion")
    write_synthetic_planetoid(root / "raw", "cora", **SYNTHETIC_LAYOUTS["cora"])
    graph = parse_planetoid({name: (root / "raw" / name).read_bytes() for name in file_names("cora")}, "cora")
    prepared = root / "data/prepared/cora"
    prepared.mkdir(parents=True)
    torch.save(graph_to_tensors(graph), prepared / "graph.pt")
    (prepared / "meta.json").write_text(json.dumps({"dataset": "cora", "source_sha256": {}}))
    params = (REPO / "params.yaml").read_text()
    (root / "params.yaml").write_text(re.sub(r"^(\s+max_epochs:) \d+", r"\1 4", params, flags=re.M))
    # The stages run in the temporary folder (its params.yaml): PYTHONPATH makes them this checkout's code.
    env = clean_env() | {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "PYTHONPATH": str(REPO)}
    train = _stage(root, env, "-m", "stages.train", "--data", "data/prepared/cora", "--out", "data/train")
    _stage(root, env, "-m", "stages.evaluate", "--data", "data/prepared/cora", "--train", "data/train",
           "--out", "data/eval")
    return Champion(root, env, train)


@pytest.mark.e2e
def test_training_prints_its_line_and_no_mlflow_warning(champion: Champion) -> None:
    """No pickle warning (the model is tensor files and code), no INFO line, no progress bar: the result alone."""
    assert re.fullmatch(r"cora: stopped after \d+ epochs, restored epoch \d+ \(val acc \d\.\d{4}\) -> data/train\n",
                        champion.train.stdout), champion.train.stdout
    assert champion.train.stderr == ""


@pytest.mark.e2e
def test_the_loaded_model_equals_the_trained_model_bit_for_bit(champion: Champion, tmp_path: Path) -> None:
    import mlflow

    run = json.loads((champion.root / "data/train/run.json").read_text())
    mlflow.set_tracking_uri(champion.env["MLFLOW_TRACKING_URI"])
    loaded = mlflow.pyfunc.load_model(run["model_uri"], dst_path=str(tmp_path))  # not MLflow's /tmp folder, left
    every_node = np.arange(NODES)
    expected = champion.classifier()(torch.from_numpy(every_node)).numpy()
    predicted = loaded.predict(every_node)
    assert predicted.dtype == expected.dtype == np.float32 and predicted.shape == (NODES, 7)
    assert predicted.tobytes() == expected.tobytes()
    # No input schema (MLflow's server would cast 1.9 to 1 by it); the metadata says what the model takes.
    info = mlflow.models.get_model_info(run["model_uri"])
    assert info.signature.inputs is None
    assert info.metadata == {"input": f"node ids: a non-empty list of int64 from 0 to {NODES - 1}"}
    # What was logged is tensor files and code: nothing in the model is a pickled object.
    local = Path(mlflow.artifacts.download_artifacts(run["model_uri"], dst_path=str(champion.root / "model")))
    assert sorted(path.name for path in (local / "artifacts").iterdir()) == ["dataset.txt", "graph.pt", "model.pt"]
    assert not list(local.rglob("*.pkl")) and not list(local.rglob("*.pth"))


def _running(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie, exited but not yet reaped, does not)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return running


def _lines(stream) -> "queue.Queue[str]":
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def _post(url: str, body: Any) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def served(champion: Champion, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, list[int]]]:
    """`python -m tools.serve` on a free port: the process, its address, and its children's PIDs (the mlflow CLI
    and uvicorn), which the test checks are gone after the stop. Its temporary folders go to `tmp_path`: a SIGKILL
    leaves the champion's copy there, which pytest then removes."""
    import psutil

    port = free_port()
    process = subprocess.Popen([*WITH_DEFAULT_SIGNALS, str(VENV_BIN / "python"), "-m", "tools.serve", "--port",
                                str(port)], cwd=REPO, env={**champion.env, "TMPDIR": str(tmp_path)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines, deadline = _lines(process.stdout), time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "tools.serve printed no address"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line.startswith("serving "):
                break
        assert re.fullmatch(rf"serving gat-cora version 1 \(@champion, val_acc \d\.\d{{4}}\) at "
                            rf"http://127\.0\.0\.1:{port}/invocations; Ctrl-C stops it\n", line), line
        children = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
        yield process, f"http://127.0.0.1:{port}", children
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)  # the test failed before its own stop
            process.wait(timeout=STOP_TIMEOUT_S)


@pytest.mark.e2e
def test_the_served_champion_answers_node_ids_and_refuses_bad_ones_in_one_sentence(
        champion: Champion, served: tuple[subprocess.Popen, str, list[int]], tmp_path: Path) -> None:
    process, base, children = served
    nodes = [0, 1, 1139, 17]
    status, body = _post(f"{base}/invocations", {"inputs": nodes})
    assert status == 200, body
    expected = champion.classifier()(torch.tensor(nodes)).numpy()
    # Equal up to float32 rounding: the server computes with all cores (the tests with one), which sums in another
    # order; the bit-for-bit check is in-process (test_the_loaded_model_equals_the_trained_model_bit_for_bit).
    predictions = np.array(body["predictions"], dtype=np.float32)
    assert np.allclose(predictions, expected, rtol=0, atol=1e-6)
    assert predictions.argmax(-1).tolist() == expected.argmax(-1).tolist()
    for given, got in BAD:
        status, body = _post(f"{base}/invocations", {"inputs": given})
        assert (status, body["error_code"]) == (400, "INVALID_PARAMETER_VALUE"), body
        assert body["message"] == SENTENCE.format(last=NODES - 1, nodes=NODES, got=got)
        assert "stack_trace" not in body and "Traceback" not in json.dumps(body) and str(REPO) not in json.dumps(body)

    # Ctrl-C (SIGINT to this process alone: the server runs in a session of its own) stops it and its children.
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=STOP_TIMEOUT_S) == 128 + signal.SIGINT
    assert "error: interrupted by SIGINT: stopping the model server." in (process.stderr.read() if process.stderr
                                                                          else "")
    assert children and not _running(children)
    assert list(tmp_path.glob("gat-serve-*")) == []  # the champion's copy is removed on the way out
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{base}/ping", timeout=5)


@pytest.mark.e2e
def test_a_killed_serve_takes_its_server_with_it(served: tuple[subprocess.Popen, str, list[int]]) -> None:
    """SIGKILL leaves no chance to clean up: the kernel's parent-death signal stops the server all the same."""
    process, base, children = served
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _running(children):
        assert time.monotonic() < deadline, f"still running: {_running(children)}"
        time.sleep(0.2)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{base}/ping", timeout=5)
