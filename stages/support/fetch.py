"""Fetching raw files, checked against the pinned SHA-256 list that gat.datasets holds.

The source is `download.base_url`, or `GAT_DATA_MIRROR` when set: an http(s) base URL,
or a local folder (a path, relative to the repository root, or a file:// URL).
Transient failures (connection errors, timeouts, truncated bodies, HTTP 5xx) are
retried with exponential backoff; a 4xx, a redirect loop, a transfer slower than
MIN_RATE_BYTES_S, response headers that take over 2 x timeout_s + 1 s (a server that trickles
them), a size other than the pinned one (gat/planetoid.sizes: announced, or a body that runs past it, which is cut
off there) or a checksum mismatch fails at once.

A mirror URL may carry credentials (`https://user:password@host/...`): requests sends
them, but every message, log line and MLflow param shows the URL through `redact` (stages.support.redaction).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping, NoReturn

import requests
import urllib3
from tqdm import tqdm
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from gat.config import GraphSource, Params
from gat.datasets import DATASETS, ChecksumError, check_sha256, check_size, verify_raw
from stages.support.params import fail, repo_root
from stages.support.redaction import redact, redact_text

MIRROR_ENV = "GAT_DATA_MIRROR"
# What a failed Planetoid download tells the user to check.
_PLANETOID_SETTING = f"download.base_url in params.yaml or {MIRROR_ENV}"

# The one file of an npz graph (params.yaml's `graphs`) in data/raw/<name>/, whatever its source calls it.
GRAPH_FILE = "graph.npz"

# Seconds before retry k is BACKOFF_S * 2**k; tests set it to 0.
BACKOFF_S = 0.5
_CHUNK = 1 << 16

# A file may take download.timeout_s plus one second per this many bytes received; a slower
# transfer (a server that drips a byte at a time never trips the per-read timeout) fails at
# once, not retried: it has had its whole allowance, and retries would multiply the wait the
# deadline exists to bound. 4 KiB/s gives Citeseer's allx (581 KiB) 145 s
# on top of timeout_s, enough for a poor link; Pubmed's allx (7.2 MiB) gets 31 minutes.
MIN_RATE_BYTES_S = 4 * 1024


class _Transient(Exception):
    """A failed attempt worth repeating: a 5xx or a body shorter than announced."""


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def pinned(dataset: str) -> dict[str, str]:
    """File name -> pinned SHA-256 of `dataset`'s eight raw files (gat.datasets), or a StageError saying what to pin."""
    try:
        return DATASETS[dataset].checksums()
    except ChecksumError as error:
        fail(str(error))


def pinned_sizes(dataset: str) -> dict[str, int]:
    """File name -> pinned size in bytes of `dataset`'s eight raw files (gat.datasets), or a StageError."""
    try:
        return DATASETS[dataset].sizes()
    except ChecksumError as error:
        fail(str(error))


def resolve_source(base_url: str) -> str | Path:
    """The base URL (str, no trailing slash) or local folder (Path) to fetch from."""
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if not mirror:
        return base_url.rstrip("/")
    if mirror.startswith(("http://", "https://")):
        return mirror.rstrip("/")
    if mirror.startswith("file://"):
        folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(mirror).path))
    elif "://" in mirror:
        fail(f"{MIRROR_ENV}={redact(mirror)!r}: only http(s) URLs and local folders are supported; fix or unset it.")
    else:
        folder = Path(mirror)
    folder = folder if folder.is_absolute() else repo_root() / folder
    if not folder.is_dir():
        fail(f"{MIRROR_ENV}={mirror!r}: {folder} is not a folder; point it at a folder holding the "
             "ind.<dataset>.* files, or unset it to download from download.base_url.")
    return folder


def _too_slow(url: str, received: int, announced: str | None, elapsed: float) -> NoReturn:
    size = f"{received:,} of {int(announced):,} bytes" if announced else f"{received:,} bytes"
    fail(f"downloading {redact(url)} too slowly: {size} in {elapsed:.0f} s ({received / elapsed / 1024:.2f} KiB/s; "
         f"each file may take download.timeout_s plus 1 s per {MIN_RATE_BYTES_S // 1024} KiB; not retried). "
         f"Raise download.timeout_s in params.yaml, or set {MIRROR_ENV} to a faster mirror or a local folder.")


class _Sockets:
    """The sockets a session has opened, so that a deadline can cut the one a request is stuck on."""

    def __init__(self) -> None:
        self.opened: list[socket.socket] = []

    def session(self) -> requests.Session:
        """A requests session whose connections record their sockets here."""
        opened = self.opened

        class Connection(HTTPConnection):
            def _new_conn(self) -> socket.socket:
                opened.append(sock := super()._new_conn())
                return sock

        class TLSConnection(HTTPSConnection):
            def _new_conn(self) -> socket.socket:
                opened.append(sock := super()._new_conn())
                return sock

        pools = {"http": type("Pool", (HTTPConnectionPool,), {"ConnectionCls": Connection}),
                 "https": type("TLSPool", (HTTPSConnectionPool,), {"ConnectionCls": TLSConnection})}
        session = requests.Session()
        for adapter in session.adapters.values():
            if isinstance(adapter, requests.adapters.HTTPAdapter):  # the only kind a new session has
                adapter.poolmanager.pool_classes_by_scheme = pools
        return session

    def cut(self) -> None:
        """Shut every socket down: a thread blocked reading one wakes up at once, at end of stream."""
        for sock in self.opened:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already


@contextlib.contextmanager
def _headers_deadline(sockets: _Sockets, url: str, timeout_s: float) -> Iterator[None]:
    """Fail when the block (connecting, then reading the status line and headers) takes over 2 · timeout_s + 1 s.

    requests' timeout bounds the connect and each socket read, so a server that sends its headers a byte
    per second would hold the download forever; a timer cuts the connection instead. The deadline lies
    beyond a connect timeout plus a read timeout, so that a server that stalls still times out (and is
    retried) as before; only one that keeps trickling reaches it. The body has its own rate check.
    """
    started = time.monotonic()
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sockets.cut()

    timer = threading.Timer(2 * timeout_s + 1, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception:
        if not expired.is_set():
            raise
    finally:
        timer.cancel()
    if expired.is_set():
        fail(f"downloading {redact(url)} too slowly: no complete response headers after "
             f"{time.monotonic() - started:.0f} s (at most 2 x download.timeout_s + 1 s; not retried). "
             f"Raise download.timeout_s in params.yaml, or set {MIRROR_ENV} to a faster mirror or a local folder.")


def _get_once(session: requests.Session, sockets: _Sockets, url: str, target: Path, size: int | None,
              timeout_s: float, setting: str = _PLANETOID_SETTING) -> int:
    """`size`: the pinned bytes (None: not pinned, an npz graph, pinned by its SHA-256 alone)."""
    # identity: the checksums pin the bytes on the wire, and Content-Length then counts them.
    with _headers_deadline(sockets, url, timeout_s):
        response = session.get(url, stream=True, timeout=timeout_s, headers={"Accept-Encoding": "identity"})
    with response:
        if response.status_code >= 500:
            raise _Transient(f"HTTP {response.status_code} {response.reason}")
        if response.status_code != 200:
            fail(f"HTTP {response.status_code} {response.reason} for {redact(url)} (not retried): the file is not "
                 f"there; check {setting}.")
        announced = response.headers.get("Content-Length")
        if announced is not None and size is not None:  # another file: refused before its body is read
            check_size(target.stem, int(announced), size)
        received = 0
        started = time.monotonic()
        with open(target, "wb") as handle, tqdm(total=int(announced) if announced else None, unit="B",
                                                unit_scale=True, unit_divisor=1024, desc=target.stem,
                                                leave=False, disable=None) as bar:
            # read1 returns whatever one socket read brings, so the rate is checked at least once per
            # timeout_s; iter_content would wait for a whole chunk, a day at one byte per second.
            # At most one byte past the pinned size: a body without Content-Length that runs on is cut off there.
            limit = _CHUNK if size is None else min(_CHUNK, size + 1 - received)
            while chunk := response.raw.read1(limit, decode_content=True):
                handle.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
                elapsed = time.monotonic() - started
                if elapsed > timeout_s + received / MIN_RATE_BYTES_S:
                    _too_slow(url, received, announced, elapsed)
                if size is not None and received > size:
                    raise ChecksumError(f"{target.stem}: more than the pinned {size:,} bytes (cut off after "
                                        f"{received:,}; gat/planetoid.sizes).")
                limit = _CHUNK if size is None else min(_CHUNK, size + 1 - received)
    # urllib3 already raises on a short read; this also covers a transport that does not.
    if announced is not None and received != int(announced):
        raise _Transient(f"received {received} of {announced} bytes")
    if size is not None and received < size:  # no Content-Length: a connection cut short looks like this
        raise _Transient(f"received {received} of the pinned {size} bytes")
    return received


# Worth another attempt: the network or the server may recover. requests' own exceptions come
# from connecting and reading the headers, urllib3's from reading the body through read1.
_TRANSIENT = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
              urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.SSLError,
              _Transient)


def _download(session: requests.Session, sockets: _Sockets, url: str, target: Path, size: int | None,
              timeout_s: float, retries: int, setting: str = _PLANETOID_SETTING) -> int:
    """`setting`: the params.yaml key (or variable) that names the URL, for the messages."""
    for attempt in range(retries + 1):
        try:
            return _get_once(session, sockets, url, target, size, timeout_s, setting)
        except requests.TooManyRedirects:
            fail(f"{redact(url)} redirects in a loop (more than {session.max_redirects} redirects; not retried): "
                 f"check {setting}, and open the URL in a browser "
                 "to see where it leads.")
        except _TRANSIENT as error:
            last_error = error
            if attempt < retries:
                time.sleep(BACKOFF_S * 2**attempt)
        except (requests.RequestException, urllib3.exceptions.HTTPError) as error:
            fail(f"could not download {redact(url)} ({redact_text(str(error), url)}; not retried): check "
                 f"{setting}.")
    fail(f"could not download {redact(url)} after {retries + 1} attempts ({redact_text(str(last_error), url)}). "
         f"Check the network, raise download.retries or download.timeout_s in params.yaml, or set {MIRROR_ENV} "
         "to a mirror.")


@contextlib.contextmanager
def _verified_into(target: Path) -> Iterator[Path]:
    """A `.part` sibling of `target` to write and check in the block: renamed to `target` when the block ends
    without an error, removed either way, so a folder never holds an unverified file under its real name."""
    part = target.with_name(f"{target.name}.part")
    try:
        yield part
        part.rename(target)
    finally:
        part.unlink(missing_ok=True)


def fetch(expected: Mapping[str, str], source: str | Path, dest: Path, *, sizes: Mapping[str, int], timeout_s: float,
          retries: int) -> dict[str, int]:
    """Fetch each file named in `expected` (file name -> SHA-256) from `source` into `dest`.

    `sizes`: file name -> pinned size in bytes, checked before the checksum (a body that runs past it is cut off).
    Returns file name -> bytes.

    Each file is written to a `.part` sibling and renamed only once its size and checksum
    match, so `dest` never holds an unverified file under its real name.
    """
    fix = (f"{redact(str(source))} serves other bytes than the canonical file: if {MIRROR_ENV} is set, check the "
           "mirror's contents or unset it; if not, the file at download.base_url has changed and needs review.")
    received = {}
    sockets = _Sockets()
    with sockets.session() as session:
        for name in expected:
            with _verified_into(dest / name) as part:
                try:
                    if isinstance(source, Path):
                        if not (source / name).is_file():
                            fail(f"{source / name} is missing from the {MIRROR_ENV} folder; add it or unset "
                                 f"{MIRROR_ENV}.")
                        check_size(name, (source / name).stat().st_size, sizes[name])
                        shutil.copyfile(source / name, part)
                    else:
                        _download(session, sockets, f"{source}/{name}", part, sizes[name], timeout_s, retries)
                    received[name] = part.stat().st_size
                    check_size(name, received[name], sizes[name])  # the file may have changed while copied
                    check_sha256(name, sha256_file(part), expected[name])
                except ChecksumError as error:
                    fail(f"{error} {fix}")
    return received


def expected_files(params: Params, dataset: str) -> dict[str, str]:
    """File name -> SHA-256 of `dataset`'s raw files: a Planetoid dataset's eight pinned files, or an npz graph's
    one file (GRAPH_FILE) with its params.yaml digest; a StageError for a name that is neither."""
    graph = params.graph(dataset)
    if graph is not None:
        return {GRAPH_FILE: graph.sha256}
    if dataset not in DATASETS:
        fail(f"{dataset!r} is neither a Planetoid dataset ({', '.join(DATASETS)}) nor a key of `graphs` in "
             "params.yaml: add its `graphs` block, or pass one of those.")
    return pinned(dataset)


def graph_source(graph: GraphSource) -> str | Path:
    """An npz graph's URL, or its file (a relative path is taken from the repository root, as DVC runs stages)."""
    if graph.is_url:
        return graph.source
    path = Path(graph.source).expanduser()
    return path if path.is_absolute() else repo_root() / path


def fetch_graph(name: str, graph: GraphSource, dest: Path, *, timeout_s: float, retries: int) -> int:
    """Download (or copy) the npz graph `graphs.<name>` into `dest`/GRAPH_FILE, checked against its sha256.

    Returns its bytes. Like `fetch`, the file gets its name only once its checksum matches.
    """
    key = f"graphs.{name}"
    source = graph_source(graph)
    sockets = _Sockets()
    with _verified_into(dest / GRAPH_FILE) as part:
        if isinstance(source, Path):
            if not source.is_file():
                fail(f"{key}.source: {source} is not a file; fix the path in params.yaml (a relative path is "
                     "taken from the repository root).")
            shutil.copyfile(source, part)
            size = part.stat().st_size
        else:
            with sockets.session() as session:
                size = _download(session, sockets, source, part, None, timeout_s, retries,
                                 f"{key}.source in params.yaml")
        actual = sha256_file(part)
        try:
            check_sha256(f"{key}.source ({redact(str(source))})", actual, graph.sha256,
                         pinned_in=f"{key}.sha256 in params.yaml")
        except ChecksumError as error:
            fail(f"{error} If this is the file you mean, set `{key}.sha256: {actual}` in params.yaml.")
    return size


def read_verified(folder: Path, expected: Mapping[str, str], producer: str) -> dict[str, bytes]:
    """Read each file in `expected` from `folder` after its checksum matches; file name -> bytes.

    `producer` is the DVC stage that makes `folder`, named in the fix.
    """
    raw = {}
    for name in expected:
        path = folder / name
        if not path.is_file():
            fail(f"{path} is missing: run `dvc repro --force {producer}` to download it again.")
        raw[name] = path.read_bytes()
    try:
        verify_raw(raw, expected, where=f"{folder}/")
    except ChecksumError as error:
        fail(f"{error} The file was changed or comes from elsewhere: run `dvc repro --force {producer}` "
             "to download it again.")
    return raw
