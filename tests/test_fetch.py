"""stages.support.fetch: downloads from a loopback server and a local mirror, retries, checksums."""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from typing import Callable

import pytest
from conftest import LoopbackServer, PlanetoidFolder

from gat import datasets
from gat.datasets import file_names
from stages.support import fetch, redaction
from stages.support.files import atomic_dir
from stages.support.params import StageError

NAMES = file_names("cora")


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.0)


@pytest.fixture(autouse=True)
def pinned_sizes(monkeypatch: pytest.MonkeyPatch, planetoid_folder: PlanetoidFolder) -> None:
    """The folder's file sizes pinned, as its checksums are in `_expected`."""
    monkeypatch.setattr(datasets, "SIZES", planetoid_folder.sizes)


def _fetch_into(out: Path, source: str | Path, expected: dict[str, str], retries: int = 2) -> dict[str, int]:
    with atomic_dir(out) as staging:
        return fetch.fetch(expected, source, staging, sizes=datasets.pinned_sizes(expected), timeout_s=5,
                           retries=retries)


def _expected(planetoid_folder: PlanetoidFolder) -> dict[str, str]:
    return {name: planetoid_folder.checksums[name] for name in NAMES}


def test_good_download_is_verified(planetoid_folder: PlanetoidFolder, planetoid_url: str, tmp_path: Path) -> None:
    out = tmp_path / "raw" / "cora"
    sizes = _fetch_into(out, planetoid_url, _expected(planetoid_folder))
    assert sorted(path.name for path in out.iterdir()) == sorted(NAMES)
    assert sizes == {name: (planetoid_folder.path / name).stat().st_size for name in NAMES}
    assert {name: fetch.sha256_file(out / name) for name in NAMES} == _expected(planetoid_folder)


def test_wrong_checksum_fails_and_leaves_nothing(planetoid_folder: PlanetoidFolder, planetoid_url: str,
                                                 tmp_path: Path) -> None:
    expected = _expected(planetoid_folder) | {"ind.cora.tx": "0" * 64}
    out = tmp_path / "raw" / "cora"
    message = r"ind\.cora\.tx: SHA-256 is [0-9a-f]{64}, but 0{64} is pinned.*GAT_DATA_MIRROR"
    with pytest.raises(StageError, match=message):
        _fetch_into(out, planetoid_url, expected)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


def test_previous_output_survives_a_failure(planetoid_folder: PlanetoidFolder, planetoid_url: str,
                                            tmp_path: Path) -> None:
    out = tmp_path / "cora"
    out.mkdir()
    (out / "old").write_text("kept")
    with pytest.raises(StageError):
        _fetch_into(out, planetoid_url, _expected(planetoid_folder) | {"ind.cora.y": "0" * 64})
    assert [path.name for path in out.iterdir()] == ["old"]


def test_truncated_body_is_retried_then_fails(planetoid_folder: PlanetoidFolder,
                                              serve_folder: Callable[..., LoopbackServer], tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.y": ["truncate"] * 3})
    out = tmp_path / "cora"
    with pytest.raises(StageError, match=r"could not download .*/ind\.cora\.y after 3 attempts"):
        _fetch_into(out, server.base_url, _expected(planetoid_folder), retries=2)
    assert server.requests.count("ind.cora.y") == 3
    assert list(tmp_path.iterdir()) == []


def test_truncated_body_then_success(planetoid_folder: PlanetoidFolder,
                                     serve_folder: Callable[..., LoopbackServer], tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.allx": ["truncate"]})
    _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder))
    assert server.requests.count("ind.cora.allx") == 2


def test_503_then_200_succeeds(planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer],
                               tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.x": ["503", "503"]})
    _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder), retries=2)
    assert server.requests.count("ind.cora.x") == 3
    assert fetch.sha256_file(tmp_path / "cora" / "ind.cora.x") == planetoid_folder.checksums["ind.cora.x"]


def test_404_fails_at_once_naming_the_url(planetoid_folder: PlanetoidFolder,
                                          serve_folder: Callable[..., LoopbackServer], tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.graph": ["404"]})
    message = r"HTTP 404 .* for http://127\.0\.0\.1:\d+/data/ind\.cora\.graph \(not retried\)"
    with pytest.raises(StageError, match=message):
        _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder), retries=3)
    assert server.requests.count("ind.cora.graph") == 1
    assert list(tmp_path.iterdir()) == []


def test_connection_refused_is_retried_then_fails(planetoid_folder: PlanetoidFolder, tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(StageError, match="after 2 attempts.*GAT_DATA_MIRROR"):
        _fetch_into(tmp_path / "cora", f"http://127.0.0.1:{port}", _expected(planetoid_folder), retries=1)


@pytest.mark.parametrize("form", ["absolute", "file_url", "relative"])
def test_local_folder_mirror(planetoid_folder: PlanetoidFolder, monkeypatch: pytest.MonkeyPatch,
                             tmp_path: Path, form: str) -> None:
    mirror = {"absolute": str(planetoid_folder.path), "file_url": planetoid_folder.path.as_uri(),
              "relative": "mirror"}[form]
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # what repo_root() returns, for the relative form
    (tmp_path / "mirror").symlink_to(planetoid_folder.path)
    monkeypatch.setenv(fetch.MIRROR_ENV, mirror)
    source = fetch.resolve_source("https://example.invalid/data")
    assert source == (tmp_path / "mirror" if form == "relative" else planetoid_folder.path)
    sizes = _fetch_into(tmp_path / "cora", source, _expected(planetoid_folder))
    assert sum(sizes.values()) == sum((planetoid_folder.path / name).stat().st_size for name in NAMES)


def test_mirror_url_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fetch.MIRROR_ENV, raising=False)
    assert fetch.resolve_source("https://host/data/") == "https://host/data"
    monkeypatch.setenv(fetch.MIRROR_ENV, "http://127.0.0.1:9/planetoid/")
    assert fetch.resolve_source("https://host/data") == "http://127.0.0.1:9/planetoid"


@pytest.mark.parametrize("mirror, message", [("/no/such/folder", "is not a folder"),
                                             ("ftp://host/data", "only http\\(s\\) URLs and local folders")])
def test_bad_mirror_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, mirror: str, message: str) -> None:
    monkeypatch.setenv(fetch.MIRROR_ENV, mirror)
    with pytest.raises(StageError, match=message):
        fetch.resolve_source("https://host/data")


def test_mirror_folder_missing_a_file(planetoid_folder: PlanetoidFolder, tmp_path: Path) -> None:
    with pytest.raises(StageError, match="ind.cora.x is missing from the GAT_DATA_MIRROR folder"):
        _fetch_into(tmp_path / "cora", tmp_path, _expected(planetoid_folder))


def test_read_verified_refuses_a_changed_file(planetoid_folder: PlanetoidFolder, tmp_path: Path) -> None:
    expected = _expected(planetoid_folder)
    _fetch_into(tmp_path / "cora", planetoid_folder.path, expected)
    assert fetch.read_verified(tmp_path / "cora", expected, "download@cora").keys() == expected.keys()
    (tmp_path / "cora" / "ind.cora.x").write_bytes(b"tampered")
    with pytest.raises(StageError, match=r"ind\.cora\.x: SHA-256 .* `dvc repro --force download@cora`"):
        fetch.read_verified(tmp_path / "cora", expected, "download@cora")


@pytest.mark.parametrize("url, shown", [
    ("http://user:s3cret@host:8080/data", "http://user:***@host:8080/data"),
    ("https://t0ken@host/data", "https://***@host/data"),
    ("https://host/data", "https://host/data"),
    ("/srv/planetoid@2016", "/srv/planetoid@2016"),
])
def test_redact_hides_the_userinfo_secret(url: str, shown: str) -> None:
    assert redaction.redact(url) == shown


def _with_password(base_url: str) -> str:
    return base_url.replace("http://", "http://mirror-user:s3cr%40t@", 1)


@pytest.mark.parametrize("faults, expected", [
    ({"ind.cora.ty": ["404"]}, None),
    ({"ind.cora.ty": ["503"] * 3}, None),
    ({"ind.cora.ty": ["redirect-loop"]}, None),
    ({"ind.cora.ty": ["drip"]}, None),
    ({}, {"ind.cora.ty": "0" * 64}),
], ids=["404", "503-after-retries", "redirect-loop", "drip", "checksum-mismatch"])
def test_a_mirror_password_is_sent_but_never_shown(
        planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer], tmp_path: Path,
        faults: dict[str, list[str]], expected: dict[str, str] | None) -> None:
    server = serve_folder(planetoid_folder.path, faults=faults)
    with pytest.raises(StageError) as error:
        with atomic_dir(tmp_path / "cora") as staging:
            fetch.fetch(_expected(planetoid_folder) | (expected or {}), _with_password(server.base_url), staging,
                        sizes=datasets.pinned_sizes(NAMES),
                         timeout_s=0.5, retries=2)
    message = str(error.value)
    assert "s3cr" not in message and "mirror-user:***@127.0.0.1" in message
    # requests still authenticates with the (percent-decoded) password.
    assert base64.b64encode(b"mirror-user:s3cr@t").decode() in server.authorizations[0]


# A server that sends a byte per 0.05 s, far below MIN_RATE_BYTES_S: in the body (0.3 s of grace), or in the status
# line and headers, each byte well within the read timeout, so that only a deadline on the whole response (2 x 0.3 + 1
# = 1.6 s; the server trickles for DRIP_BYTES x 0.05 = 3 s) ends it.
TOO_SLOW = {
    "drip": r"\d+ of [\d,]+ bytes in \d+ s \([\d.]+ KiB/s; .*not retried\)\. "
            r"Raise download\.timeout_s in params\.yaml, or set GAT_DATA_MIRROR",
    "drip-headers": r"no complete response headers after \d+ s "
                    r"\(at most 2 x download\.timeout_s \+ 1 s; not retried\)\. Raise download\.timeout_s",
}


@pytest.mark.parametrize("fault", TOO_SLOW)
def test_a_dripping_server_fails_at_once_leaving_nothing(
        fault: str, planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer],
        tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.x": [fault] * 3})
    message = r"downloading http://127\.0\.0\.1:\d+/data/ind\.cora\.x too slowly: " + TOO_SLOW[fault]
    with pytest.raises(StageError, match=message):
        with atomic_dir(tmp_path / "cora") as staging:
            fetch.fetch(_expected(planetoid_folder), server.base_url, staging, sizes=datasets.pinned_sizes(NAMES),
                        timeout_s=0.3, retries=2)
    assert server.requests.count("ind.cora.x") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_redirect_loop_fails_at_once_naming_the_url(
        planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer], tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.tx": ["redirect-loop"]})
    message = r"http://127\.0\.0\.1:\d+/data/ind\.cora\.tx redirects in a loop \(more than 30 redirects; not retried\)"
    with pytest.raises(StageError, match=message):
        _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder), retries=2)
    assert server.requests.count("ind.cora.tx") == 31  # the first request and 30 redirects, once
    assert list(tmp_path.iterdir()) == []


def test_an_unparsable_url_is_refused_at_once_without_its_password(planetoid_folder: PlanetoidFolder,
                                                                   tmp_path: Path) -> None:
    # requests quotes the whole URL, password included, in its InvalidURL message.
    message = r"could not download http://user:\*\*\*@host:99999/data/ind\.cora\.x \(.*; not retried\)"
    with pytest.raises(StageError, match=message) as error:
        _fetch_into(tmp_path / "cora", "http://user:s3cret@host:99999/data", _expected(planetoid_folder))
    assert "s3cret" not in str(error.value)


def _pin_size(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, planetoid_folder: PlanetoidFolder, name: str,
              change: int) -> tuple[int, int]:
    """Pin `name` at its real size + `change` (a list of the test's own); returns (real, pinned) size."""
    sizes = datasets.parse_sizes(planetoid_folder.sizes.read_text())
    real = sizes[name]
    listing = tmp_path / "SIZES"
    listing.write_text("".join(f"{size + change * (file == name)}  {file}\n" for file, size in sizes.items()))
    monkeypatch.setattr(datasets, "SIZES", listing)
    return real, real + change


def _never_hashed(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Hashing `name` fails the test: its size is refused first."""
    sha256_file = fetch.sha256_file

    def hashed(path: Path) -> str:
        assert path.name not in (name, f"{name}.part"), f"{path} was hashed, though its size is not the pinned one"
        return sha256_file(path)

    monkeypatch.setattr(fetch, "sha256_file", hashed)


def test_an_announced_size_other_than_the_pinned_one_is_refused_at_once(
        planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    real, pinned = _pin_size(monkeypatch, tmp_path, planetoid_folder, "ind.cora.x", -1)
    _never_hashed(monkeypatch, "ind.cora.x")
    server = serve_folder(planetoid_folder.path)
    message = rf"^ind\.cora\.x: {real:,} bytes, but {pinned:,} are pinned \(gat/planetoid\.sizes\)\..*GAT_DATA_MIRROR"
    with pytest.raises(StageError, match=message):
        _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder), retries=3)
    assert server.requests == ["ind.cora.x"]  # not retried
    assert sorted(path.name for path in tmp_path.iterdir()) == ["SIZES"]


def test_a_body_without_length_that_runs_past_the_pinned_size_is_cut_off(
        planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, pinned = _pin_size(monkeypatch, tmp_path, planetoid_folder, "ind.cora.tx", -1000)
    _never_hashed(monkeypatch, "ind.cora.tx")
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.tx": ["no-length"]})
    with pytest.raises(StageError, match=rf"^ind\.cora\.tx: more than the pinned {pinned:,} bytes \(cut off after "
                                         rf"{pinned + 1:,};"):
        _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder), retries=3)
    assert server.requests.count("ind.cora.tx") == 1
    assert not (tmp_path / "cora").exists()


def test_a_body_without_length_of_the_pinned_size_is_accepted(
        planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer], tmp_path: Path) -> None:
    server = serve_folder(planetoid_folder.path, faults={name: ["no-length"] for name in NAMES})
    sizes = _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder))
    assert sizes == {name: (planetoid_folder.path / name).stat().st_size for name in NAMES}


def test_a_body_without_length_short_of_the_pinned_size_is_retried(
        planetoid_folder: PlanetoidFolder, serve_folder: Callable[..., LoopbackServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a Content-Length, a body cut short by the network looks like this: worth another attempt."""
    real, pinned = _pin_size(monkeypatch, tmp_path, planetoid_folder, "ind.cora.y", 10)
    server = serve_folder(planetoid_folder.path, faults={"ind.cora.y": ["no-length"] * 2})
    with pytest.raises(StageError, match=rf"after 2 attempts \(received {real} of the pinned {pinned} bytes\)"):
        _fetch_into(tmp_path / "cora", server.base_url, _expected(planetoid_folder), retries=1)
    assert server.requests.count("ind.cora.y") == 2


def test_a_local_file_of_another_size_is_refused_before_copying(
        planetoid_folder: PlanetoidFolder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, pinned = _pin_size(monkeypatch, tmp_path, planetoid_folder, "ind.cora.graph", 1)
    _never_hashed(monkeypatch, "ind.cora.graph")
    with pytest.raises(StageError, match=rf"^ind\.cora\.graph: {real:,} bytes, but {pinned:,} are pinned"):
        _fetch_into(tmp_path / "cora", planetoid_folder.path, _expected(planetoid_folder))
    assert not (tmp_path / "cora").exists()
