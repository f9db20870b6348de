"""Shared fixtures: Planetoid files (real or synthetic) and a loopback HTTP server.

For other test modules:

- `planetoid_folder` (session): a `PlanetoidFolder(path, real, checksums, sizes)`. The real files
  from `../shared/datasets/planetoid` when present, else synthetic cora and citeseer files
  in the same format. Synthetic files do not match `gat/planetoid.sha256` and `gat/planetoid.sizes`, so
  code that verifies against the pinned lists needs `planetoid_folder.real` (or a patched
  `gat.datasets.CHECKSUMS` and `gat.datasets.SIZES`: `sizes` is a list in that format, of either kind of files).
- `serve_folder` (function): a factory `serve_folder(folder, faults=None) -> LoopbackServer`
  that serves `folder` on 127.0.0.1 until the test ends. `faults` maps a file name to the
  behaviours of its next requests, one per request (`"503"`, `"404"`, `"truncate"`: a
  body half as long as its Content-Length; `"drip"`: one byte every DRIP_INTERVAL_S, for
  at most DRIP_BYTES bytes, then the connection closes; `"drip-headers"`: the same with the
  status line and headers, which never end; `"redirect-loop"`: a redirect to
  itself, forever; `"no-length"`: the body without a Content-Length, ended by closing the connection);
  after those, the file is served normally.
- `planetoid_url` (function): the base URL of `planetoid_folder` served that way, e.g.
  for `GAT_DATA_MIRROR`.
- `paper_protocol` (session): the paper's model and optimiser (a `gat.config.Setup`), read from params.yaml,
  where they are written once (`reproduce.protocol.cora`).
- `write_synthetic_planetoid(folder, dataset, **layout)`: write one synthetic dataset and
  refresh `folder/SHA256SUMS` and `folder/SIZES`; returns the ground truth as a `SyntheticPlanetoid`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import http.server
import io
import pickle
import struct
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from scipy import sparse

from gat.config import Params, Setup
from gat.data import Graph
from gat.datasets import DATASETS, STANDARD_TRAIN_PER_CLASS, STANDARD_VAL_NODES, parse_checksums

SHARED_PLANETOID = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "planetoid"

# Sized so the standard split works: 20 training nodes per class, then 500 validation nodes.
# The classes are the real datasets' (gat.datasets), so the class names apply to synthetic files too.
SYNTHETIC_LAYOUTS = {
    "cora": dict(num_classes=DATASETS["cora"].num_classes, num_features=150, num_extra=300, num_test=200,
                 missing_test=0, seed=1),
    "citeseer": dict(num_classes=DATASETS["citeseer"].num_classes, num_features=200, num_extra=200, num_test=200,
                     missing_test=5, seed=2),
}


@dataclass(frozen=True)
class SyntheticPlanetoid:
    """The ground truth behind synthetic files, in node order.

    Shapes: features: [N, F_in] raw 0/1 counts (or TF-IDF-like weights); labels: [N], -1 for the missing test nodes;
    edges: undirected (i, j) pairs with i < j; train/val/test_idx: sorted node ids.
    """

    dataset: str
    features: np.ndarray
    labels: np.ndarray
    edges: frozenset[tuple[int, int]]
    train_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray
    num_classes: int


class _Python2Pickler(pickle._Pickler):
    """Protocol 2 with bytes written as Python 2 `str`, as in the originals.

    Python 3 writes bytes in protocol 2 as calls to `_codecs.encode`, a global the
    originals never reference and that gat.data's restricted unpickler rightly refuses.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_bytes_as_str(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_bytes_as_str


def _pickle(path: Path, value: object) -> None:
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(value)
    path.write_bytes(buffer.getvalue())


def write_checksums(folder: Path) -> dict[str, str]:
    """(Re)write `folder/SHA256SUMS` and `folder/SIZES` over every `ind.*` file there; returns file name -> SHA-256."""
    paths = sorted(folder.glob("ind.*"))
    checksums = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}
    (folder / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in checksums.items()))
    write_sizes(paths, folder / "SIZES")
    return checksums


def write_sizes(paths: list[Path], listing: Path) -> Path:
    """Write `listing` in gat/planetoid.sizes' format (`<bytes>  <name>`) for the files `paths`; returns it."""
    listing.write_text("".join(f"{path.stat().st_size}  {path.name}\n" for path in paths))
    return listing


def write_synthetic_planetoid(folder: Path, dataset: str, *, num_classes: int = DATASETS["cora"].num_classes,
                              train_per_class: int = STANDARD_TRAIN_PER_CLASS,
                              num_val: int = STANDARD_VAL_NODES, num_extra: int = 300, num_test: int = 200,
                              missing_test: int = 0, num_features: int = 150, seed: int = 0,
                              num_edges: int | None = None, tfidf: bool = False) -> SyntheticPlanetoid:
    """Write `ind.<dataset>.*` in the exact Planetoid format from random ground truth.

    Nodes 0..N_all-1 are in allx/ally (the first `num_classes * train_per_class` also in
    x/y, `train_per_class` of each class); the test block follows, in shuffled test.index
    order, with `missing_test` ids in its interior left out as in Citeseer. One allx row is
    all zero, and the adjacency lists hold duplicates and self-loops, as the real ones do.
    `num_edges`: exactly that many undirected edges between distinct nodes (else about 2 per node);
    `tfidf`: float weights in (0, 0.2) as Pubmed's rows hold, not 0/1 counts.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    num_train = num_classes * train_per_class
    num_all = num_train + num_val + num_extra
    span = num_test + missing_test
    num_nodes = num_all + span

    labels = rng.integers(0, num_classes, num_nodes)
    labels[:num_train] = rng.permutation(np.repeat(np.arange(num_classes), train_per_class))
    missing = num_all + 1 + rng.choice(span - 2, missing_test, replace=False)
    labels[missing] = -1
    features = (rng.random((num_nodes, num_features)) < 0.05).astype(np.float32)
    if tfidf:
        features *= 0.2 * (1 - rng.random((num_nodes, num_features), dtype=np.float32))
    features[missing] = 0
    features[num_train] = 0
    one_hot = np.eye(num_classes, dtype=np.int32)[labels] * (labels >= 0)[:, None]

    test_index = rng.permutation(np.setdiff1d(np.arange(num_all, num_nodes), missing))
    prefix = folder / f"ind.{dataset}"
    _pickle(Path(f"{prefix}.x"), sparse.csr_matrix(features[:num_train]))
    _pickle(Path(f"{prefix}.y"), one_hot[:num_train])
    _pickle(Path(f"{prefix}.allx"), sparse.csr_matrix(features[:num_all]))
    _pickle(Path(f"{prefix}.ally"), one_hot[:num_all])
    _pickle(Path(f"{prefix}.tx"), sparse.csr_matrix(features[test_index]))
    _pickle(Path(f"{prefix}.ty"), one_hot[test_index])
    Path(f"{prefix}.test.index").write_text("".join(f"{i}\n" for i in test_index))

    present = np.setdiff1d(np.arange(num_nodes), missing)
    if num_edges is None:
        pairs = rng.choice(present, (2 * num_nodes, 2))
        edges = frozenset((int(min(i, j)), int(max(i, j))) for i, j in pairs if i != j)
    else:  # distinct pairs of distinct nodes, drawn in one go: a few more than needed, then exactly num_edges
        pairs = np.sort(rng.choice(present, (num_edges + num_edges // 4 + 100, 2)), axis=1)
        codes = np.unique((pairs[:, 0] * num_nodes + pairs[:, 1])[pairs[:, 0] != pairs[:, 1]])
        assert codes.size >= num_edges, "too dense a graph for num_edges"
        chosen = rng.choice(codes, num_edges, replace=False)
        edges = frozenset(zip((chosen // num_nodes).tolist(), (chosen % num_nodes).tolist()))
    # Every node has an entry, isolated or not, as in the originals.
    adjacency = collections.defaultdict(list, {node: [] for node in range(num_nodes)})
    for i, j in sorted(edges):
        adjacency[i].append(j)
        adjacency[j].append(i)
    for i, j in sorted(edges)[:10]:
        adjacency[i].append(j)
    for node in present[:5]:
        adjacency[int(node)].append(int(node))
    _pickle(Path(f"{prefix}.graph"), adjacency)
    write_checksums(folder)

    return SyntheticPlanetoid(
        dataset=dataset, features=features, labels=labels, edges=edges,
        train_idx=np.arange(num_train), val_idx=np.arange(num_train, num_train + num_val),
        test_idx=np.sort(test_index), num_classes=num_classes,
    )



def write_prepared_synthetic_cora(root: Path, source_sha256: dict[str, str]) -> Graph:
    """`root`/data/prepared/cora of a synthetic Cora, as the preprocess stage writes it (graph.pt, and a meta.json
    with these source checksums); the raw files in `root`/raw. Returns the graph."""
    import json

    import torch

    from gat.data import graph_to_tensors, parse_planetoid
    from gat.datasets import file_names

    raw = root / "raw"
    write_synthetic_planetoid(raw, "cora", **SYNTHETIC_LAYOUTS["cora"])
    graph = parse_planetoid({name: (raw / name).read_bytes() for name in file_names("cora")}, "cora")
    prepared = root / "data/prepared/cora"
    prepared.mkdir(parents=True)
    torch.save(graph_to_tensors(graph), prepared / "graph.pt")
    (prepared / "meta.json").write_text(json.dumps({"dataset": "cora", "source_sha256": source_sha256}))
    return graph

@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the stages use (stages.support.interrupts.main): the tests' tensors are tiny, and a
    second OpenMP thread only adds overhead, a lot of it on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class PlanetoidFolder:
    """Where the Planetoid files are, whether they are the real ones, and their SHA256SUMS."""

    path: Path
    real: bool
    checksums: dict[str, str]
    sizes: Path  # the files' sizes, in gat/planetoid.sizes' format


@pytest.fixture(scope="session")
def paper_protocol() -> Setup:
    """The paper's model and optimiser as params.yaml writes them, once: not copied into any test."""
    from stages.support.params import parse_params_yaml

    params_yaml = Path(__file__).resolve().parents[1] / "params.yaml"
    return Params.from_dict(parse_params_yaml(params_yaml.read_text())).reproduce.protocol["cora"]


@pytest.fixture(scope="session")
def planetoid_folder(tmp_path_factory: pytest.TempPathFactory) -> PlanetoidFolder:
    if (SHARED_PLANETOID / "SHA256SUMS").is_file():
        sizes = write_sizes(sorted(SHARED_PLANETOID.glob("ind.*")), tmp_path_factory.mktemp("planetoid") / "SIZES")
        return PlanetoidFolder(SHARED_PLANETOID, True, parse_checksums((SHARED_PLANETOID / "SHA256SUMS").read_text()),
                               sizes)
    folder = tmp_path_factory.mktemp("planetoid")
    for dataset, layout in SYNTHETIC_LAYOUTS.items():
        write_synthetic_planetoid(folder, dataset, **layout)
    return PlanetoidFolder(folder, False, parse_checksums((folder / "SHA256SUMS").read_text()), folder / "SIZES")


# The "drip" fault: far slower than any download should accept, yet each byte comes well within
# a read timeout. It stops after DRIP_BYTES (about 3 s), so a client that waits does not hang the tests.
DRIP_INTERVAL_S = 0.05
DRIP_BYTES = 60
# The query that marks a request of the "redirect-loop" fault, which redirects to itself.
_LOOP_QUERY = "redirect-loop"


@dataclass
class LoopbackServer:
    """A running server: `base_url` + "/" + file name serves that file of the folder.

    `requests` lists the file names asked for, in order, and `authorizations` the
    Authorization header of each (None without one); `faults` is consumed as they come.
    """

    base_url: str
    requests: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    faults: dict[str, list[str]] = field(default_factory=dict)


class _Handler(http.server.BaseHTTPRequestHandler):
    # HTTP/1.0 closes the connection after each response, which is what ends a truncated body.
    protocol_version = "HTTP/1.0"
    server: "_Server"

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        name = url.path.rsplit("/", 1)[-1]
        state = self.server.state
        state.requests.append(name)
        state.authorizations.append(self.headers.get("Authorization"))
        if url.query == _LOOP_QUERY:  # a request the "redirect-loop" fault made: it consumes no fault
            self._redirect_to_itself(url.path)
            return
        queue = state.faults.get(name) or []
        fault = queue.pop(0) if queue else None
        path = self.server.folder / name
        if fault == "404" or not path.is_file():
            self.send_error(404)
        elif fault == "503":
            self.send_error(503)
        elif fault == "redirect-loop":
            self._redirect_to_itself(url.path)
        elif fault == "drip-headers":
            self._drip(b"HTTP/1.0 200 OK\r\nX-Slow: " + b"x" * DRIP_BYTES)  # the headers never end
        else:
            body = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            if fault != "no-length":
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault == "drip":
                self._drip(body)
            else:
                self.wfile.write(body[: len(body) // 2] if fault == "truncate" else body)

    def _redirect_to_itself(self, path: str) -> None:
        self.send_response(302)
        self.send_header("Location", f"{path}?{_LOOP_QUERY}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _drip(self, body: bytes) -> None:
        """One byte per DRIP_INTERVAL_S, until DRIP_BYTES are sent, the client hangs up or the server stops."""
        for byte in body[:DRIP_BYTES]:
            if self.server.stopping.wait(DRIP_INTERVAL_S):
                return
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:  # the client gave up, as it should
                return

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep pytest output clean


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, folder: Path, state: LoopbackServer) -> None:
        self.folder = folder
        self.state = state
        self.stopping = threading.Event()  # ends the handlers that are still dripping
        super().__init__(("127.0.0.1", 0), _Handler)


@contextlib.contextmanager
def serving(folder: Path, faults: dict[str, list[str]] | None = None) -> Iterator[LoopbackServer]:
    """Serve `folder` on 127.0.0.1 for the duration of the block."""
    state = LoopbackServer(base_url="", faults={name: list(queue) for name, queue in (faults or {}).items()})
    server = _Server(Path(folder), state)
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}/data"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield state
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def serve_folder() -> Iterator[Callable[..., LoopbackServer]]:
    with contextlib.ExitStack() as stack:
        yield lambda folder, faults=None: stack.enter_context(serving(folder, faults))


@pytest.fixture
def planetoid_url(planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer]) -> str:
    return serve_folder(planetoid_folder.path).base_url


def run_stage_in_process(monkeypatch: pytest.MonkeyPatch, module: str, run: Callable[[], None], *args: str) -> int:
    """A stage as `python -m <module> ARGS` runs it, but in this process: its exit code (0, or main()'s).

    main() installs its own SIGTERM handler; the test process gets its own back.
    """
    import signal
    import sys

    from stages.support.interrupts import main

    monkeypatch.setattr(sys, "argv", [module, *args])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        main(run)
        return 0
    except SystemExit as exit:
        return int(exit.code or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)


# The end-to-end fixtures live in their own module; importing them here makes them visible to every test file.
from pipeline_support import pipeline, pipeline_copy, planetoid_server  # noqa: E402,F401
from team_support import seaweedfs_stopped, team_backend, team_credentials, team_pipeline  # noqa: E402,F401

# The tiers (`make test`: none of these; `make test-all`: everything), by what a test needs to run. A marker follows
# from a test's fixtures, so a new test that needs the pipeline or a server is marked without anyone remembering to.
TIER_FIXTURES = {
    "e2e": {"pipeline", "pipeline_copy", "sqlite_stages"},  # the real `dvc repro` of the tiny pipeline, or stages
    # PostgreSQL, SeaweedFS, MLflow
    "team": {"team_backend", "team_pipeline", "server_stages", "seaweedfs_stopped", "team_recipe_folder"},
    "dask": {"dask_cluster", "doomed_cluster"},  # a Dask scheduler and workers
    "multihost": {"team_hosts"},  # hosts in network namespaces: the team backend, a Dask cluster, two colleagues
}


# A command's prefix that starts it with Ctrl-C's and SIGHUP's default actions, as from a terminal: a test runner that
# itself runs as a background job (`nohup .ci/run &`, some CI runners) ignores SIGINT, one under `nohup` ignores
# SIGHUP, and its children would inherit that (a stage or a server keeps ignoring what it was started ignoring, as
# `nohup` means it to). The tests that press Ctrl-C or hang up on a process start it behind this.
WITH_DEFAULT_SIGNALS = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"]


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI runner's timeout, `kill PID`) stops the suite as Ctrl-C does, so pytest tears the fixtures down
    and the servers and clusters they started stop with it. Python's default action ends the process at once and
    leaves them running: a PostgreSQL started by `pg_ctl` under `runuser` outlives its parent. A second SIGTERM, during
    the teardown, ends the process at once."""
    import signal

    def interrupt(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for marker, needs in TIER_FIXTURES.items():
            if fixtures & needs:
                item.add_marker(marker)
