"""gat.datasets: the one registry of dataset facts, its pinned checksums and the check of raw bytes against them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import PlanetoidFolder

from gat import datasets
from gat.datasets import DATASETS, ChecksumError, PaperResult, file_names, pinned_checksums, verify_raw


def test_the_registry_holds_cora_and_citeseer_with_their_facts() -> None:
    assert list(DATASETS) == ["cora", "citeseer"]
    cora, citeseer = DATASETS["cora"], DATASETS["citeseer"]
    assert (cora.num_classes, citeseer.num_classes) == (7, 6)
    assert cora.class_names[0] == "Theory" and citeseer.class_names[-1] == "HCI"
    assert cora.paper == PaperResult(0.830, 0.007) and citeseer.paper == PaperResult(0.725, 0.007)
    assert cora.file_names == file_names("cora") and cora.file_names[0] == "ind.cora.x"
    assert cora.file_names[-1] == "ind.cora.test.index" and len(citeseer.file_names) == 8


def test_paper_band() -> None:
    cora, citeseer = DATASETS["cora"].paper, DATASETS["citeseer"].paper
    assert citeseer.contains(0.725 + 0.007) and citeseer.contains(0.725 - 0.007)
    assert not cora.contains(0.8229) and not cora.contains(0.8371)


def test_every_dataset_has_its_eight_files_pinned() -> None:
    for dataset in DATASETS.values():
        pinned = dataset.checksums()
        assert list(pinned) == dataset.file_names and all(len(digest) == 64 for digest in pinned.values())
    assert len(pinned_checksums()) == 8 * len(DATASETS)


def test_an_unpinned_file_is_an_error_naming_it() -> None:
    with pytest.raises(ChecksumError, match="ind.pubmed.x.*not pinned"):
        pinned_checksums(["ind.pubmed.x"])


def test_pinned_checksums_match_the_real_files(planetoid_folder: PlanetoidFolder) -> None:
    if not planetoid_folder.real:
        pytest.skip("the real Planetoid files (../shared/datasets/planetoid) are not here")
    assert pinned_checksums() == planetoid_folder.checksums


def test_tests_can_pin_their_own_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = tmp_path / "SHA256SUMS"
    listed.write_text("# a comment\n" + "".join(f"{'ab' * 32}  *{name}\n" for name in file_names("cora")))
    monkeypatch.setattr(datasets, "CHECKSUMS", listed)
    assert DATASETS["cora"].checksums() == {name: "ab" * 32 for name in file_names("cora")}


def test_verify_raw_refuses_other_bytes_and_names_the_file() -> None:
    raw = {"ind.cora.x": b"right", "ind.cora.y": b"wrong"}
    expected = {name: hashlib.sha256(b"right").hexdigest() for name in raw}
    verify_raw({"ind.cora.x": b"right"}, {"ind.cora.x": expected["ind.cora.x"]})
    with pytest.raises(ChecksumError, match=r"^data/ind\.cora\.y: SHA-256 is [0-9a-f]{64}, but .* is pinned"):
        verify_raw(raw, expected, where="data/")
