"""gat.datasets: the one registry of dataset facts, its pinned checksums and the check of raw bytes against them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import PlanetoidFolder

from gat import datasets
from gat.datasets import (DATASETS, ChecksumError, PaperResult, check_size, file_names, pinned_checksums,
                          pinned_sizes, verify_raw)

# The real Pubmed files' SHA-256 and sizes, as the issue pins them; seven were checked against tkipf/gcn and
# kimiyoung/planetoid (README, "Pubmed"), allx's are its Git LFS pointer's.
PUBMED_PINS = {
    "ind.pubmed.x": ("fbe9cb5c47200d1b7769a26e579be3b7130b556831f9d850e77c4c74f2599b33", 23172),
    "ind.pubmed.y": ("e6c807633307a07ed659249006536a147c7999c797f11a2560752990181b41b3", 854),
    "ind.pubmed.tx": ("4eb5f5d0f30f26497eb0ac6ac9719d09c67e284f1ed0385c93f3ef27a671da3d", 405505),
    "ind.pubmed.ty": ("ee2e0d4819d9fbcc403689c3bf2e49face401b605932f093bc58ab6461130fdd", 12135),
    "ind.pubmed.allx": ("508e538e2abdccdd54c4d3e9f49d638b4af7107d85845f66ddea5a5152658b7e", 7578385),
    "ind.pubmed.ally": ("0c37bbe3b5014ec365e9d393cf4791925e5ed94fb194305d74f064a8d7b50f0e", 224739),
    "ind.pubmed.graph": ("5b89f0036ca22909471f1e6558eb42fa06e0c730a577bde5b058b40638f81dc9", 471808),
    "ind.pubmed.test.index": ("b101d421688bbaecbd82e8a18f1e282378d6830f3a37666f28ebc47f844341b5", 6000),
}


def test_the_registry_holds_cora_citeseer_and_pubmed_with_their_facts() -> None:
    assert list(DATASETS) == ["cora", "citeseer", "pubmed"]
    cora, citeseer = DATASETS["cora"], DATASETS["citeseer"]
    assert (cora.num_classes, citeseer.num_classes) == (7, 6)
    assert cora.class_names[0] == "Theory" and citeseer.class_names[-1] == "HCI"
    assert cora.paper == PaperResult(0.830, 0.007) and citeseer.paper == PaperResult(0.725, 0.007)
    assert cora.file_names == file_names("cora") and cora.file_names[0] == "ind.cora.x"
    assert cora.file_names[-1] == "ind.cora.test.index" and len(citeseer.file_names) == 8
    pubmed = DATASETS["pubmed"]
    assert pubmed.class_names == ("Diabetes_Mellitus_Experimental", "Diabetes_Mellitus_Type_2",
                                  "Diabetes_Mellitus_Type_1")
    assert pubmed.paper == PaperResult(0.790, 0.003)


def test_pubmed_is_pinned_by_sha256_and_size() -> None:
    assert DATASETS["pubmed"].checksums() == {name: digest for name, (digest, _) in PUBMED_PINS.items()}
    assert DATASETS["pubmed"].sizes() == {name: size for name, (_, size) in PUBMED_PINS.items()}


def test_paper_band() -> None:
    cora, citeseer = DATASETS["cora"].paper, DATASETS["citeseer"].paper
    assert citeseer.contains(0.725 + 0.007) and citeseer.contains(0.725 - 0.007)
    assert not cora.contains(0.8229) and not cora.contains(0.8371)


def test_every_dataset_has_its_eight_files_pinned() -> None:
    for dataset in DATASETS.values():
        pinned = dataset.checksums()
        assert list(pinned) == dataset.file_names and all(len(digest) == 64 for digest in pinned.values())
        assert list(dataset.sizes()) == dataset.file_names and all(size > 0 for size in dataset.sizes().values())
    assert len(pinned_checksums()) == len(pinned_sizes()) == 8 * len(DATASETS)


def test_an_unpinned_file_is_an_error_naming_it() -> None:
    with pytest.raises(ChecksumError, match="ind.reddit.x.*not pinned"):
        pinned_checksums(["ind.reddit.x"])
    with pytest.raises(ChecksumError, match=r"ind\.reddit\.x not pinned in .*planetoid\.sizes"):
        pinned_sizes(["ind.reddit.x"])


def test_pinned_checksums_and_sizes_match_the_real_files(planetoid_folder: PlanetoidFolder) -> None:
    if not planetoid_folder.real:
        pytest.skip("the real Planetoid files (../shared/datasets/planetoid) are not here")
    assert pinned_checksums(planetoid_folder.checksums) == planetoid_folder.checksums
    real_sizes = {name: (planetoid_folder.path / name).stat().st_size for name in planetoid_folder.checksums}
    assert pinned_sizes(real_sizes) == real_sizes


def test_a_wrong_size_is_one_line_naming_the_file() -> None:
    check_size("ind.cora.x", 22119, 22119)
    with pytest.raises(ChecksumError, match=r"^ind\.cora\.x: 22,120 bytes, but 22,119 are pinned \(gat/planetoid"):
        check_size("ind.cora.x", 22120, 22119)


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
