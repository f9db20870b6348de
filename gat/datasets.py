"""The one registry of what the project knows about each dataset, and the check of raw files against it.

Each dataset's entry holds its name, its eight raw Planetoid files (`ind.<name>.<part>`), their pinned
SHA-256 and sizes (the package-data files gat/planetoid.sha256 and gat/planetoid.sizes), its class names and the
paper's result. Everything else (params validation, the stages, the figures, the benchmarks, the tests' synthetic
data) reads it here, so that adding a dataset or re-pinning a file is one edit. The paper's protocol (model and
optimiser) is not here: it is a parameter, written once in params.yaml.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Iterable, Mapping

# The raw files' parts, in the order gat.data reads them.
PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")

# The standard Planetoid split, the paper's: the rows of `x`/`y` are the training nodes (20 per class in the
# real files), the STANDARD_VAL_NODES right after them the validation nodes, and test.index lists the test nodes.
STANDARD_TRAIN_PER_CLASS = 20
STANDARD_VAL_NODES = 500

# The pinned SHA-256 of every raw file, in `sha256sum` format. Tests point this at a list of their own.
CHECKSUMS: Traversable | Path = resources.files("gat") / "planetoid.sha256"
# The pinned size in bytes of every raw file, `<bytes>  <name>` a line (`stat -c '%s  %n' ind.*`). Tests point this at
# a list of their own too.
SIZES: Traversable | Path = resources.files("gat") / "planetoid.sizes"


class ChecksumError(ValueError):
    """A raw file is not pinned, or its bytes (or its size) are not the pinned ones."""


@dataclass(frozen=True)
class PaperResult:
    """Test accuracy as Table 3 of the paper reports it: mean ± std over 100 runs (fractions)."""

    mean: float
    std: float

    def contains(self, value: float) -> bool:
        """Whether `value` lies inside the paper's mean ± std band."""
        return self.mean - self.std <= value <= self.mean + self.std


def file_names(dataset: str) -> list[str]:
    """The eight raw file names of `dataset`, in `PARTS` order: `ind.cora.x`, ..."""
    return [f"ind.{dataset}.{part}" for part in PARTS]


@dataclass(frozen=True)
class Dataset:
    """One Planetoid dataset. `class_names` name the one-hot label columns in order.

    The raw files carry no class names; each column was matched to its subject area by its node count
    (Cora: 351 Theory, 217 Reinforcement_Learning, ... as in the LINQS release, whose per-class counts
    are all distinct). Pubmed's columns count 4,103, 7,739 and 7,875 nodes in ally + ty (the real files), which
    are Diabetes_Mellitus_Experimental's, Type_2's and Type_1's in the LINQS Pubmed-Diabetes release.
    """

    name: str
    class_names: tuple[str, ...]
    paper: PaperResult

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def file_names(self) -> list[str]:
        return file_names(self.name)

    def checksums(self) -> dict[str, str]:
        """File name -> pinned SHA-256 of the eight raw files, read from `CHECKSUMS` now."""
        return pinned_checksums(self.file_names)

    def sizes(self) -> dict[str, int]:
        """File name -> pinned size in bytes of the eight raw files, read from `SIZES` now."""
        return pinned_sizes(self.file_names)


DATASETS: Mapping[str, Dataset] = {dataset.name: dataset for dataset in (
    Dataset("cora", ("Theory", "Reinforcement_Learning", "Genetic_Algorithms", "Neural_Networks",
                     "Probabilistic_Methods", "Case_Based", "Rule_Learning"), PaperResult(0.830, 0.007)),
    Dataset("citeseer", ("AI", "ML", "IR", "DB", "Agents", "HCI"), PaperResult(0.725, 0.007)),
    Dataset("pubmed", ("Diabetes_Mellitus_Experimental", "Diabetes_Mellitus_Type_2", "Diabetes_Mellitus_Type_1"),
            PaperResult(0.790, 0.003)),
)}


def parse_checksums(text: str) -> dict[str, str]:
    """File name -> SHA-256 from `sha256sum`-format text (`#` lines are comments)."""
    checksums = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name = line.split(maxsplit=1)
            checksums[name.lstrip("*")] = digest.lower()
    return checksums


def parse_sizes(text: str) -> dict[str, int]:
    """File name -> size in bytes from `<bytes>  <name>` lines (`#` lines are comments)."""
    return {name: int(size) for size, name in (line.split(maxsplit=1) for line in text.splitlines()
                                               if line.strip() and not line.startswith("#"))}


def _only(pins: dict, names: Iterable[str] | None, listing: Traversable | Path, what: str) -> dict:
    """`pins` (all of `listing`), or with `names` only those, each of which must be pinned."""
    if names is None:
        return pins
    names = list(names)
    unpinned = [name for name in names if name not in pins]
    if unpinned:
        raise ChecksumError(f"{', '.join(unpinned)} not pinned in {listing}: add their {what}.")
    return {name: pins[name] for name in names}


def pinned_checksums(names: Iterable[str] | None = None) -> dict[str, str]:
    """File name -> pinned SHA-256 (all of `CHECKSUMS`); with `names`, only those, and each must be pinned."""
    return _only(parse_checksums(CHECKSUMS.read_text()), names, CHECKSUMS, "SHA-256 there (sha256sum format)")


def pinned_sizes(names: Iterable[str] | None = None) -> dict[str, int]:
    """File name -> pinned size in bytes (all of `SIZES`); with `names`, only those, and each must be pinned."""
    return _only(parse_sizes(SIZES.read_text()), names, SIZES, "sizes there (`stat -c '%s  %n'` format)")


def check_sha256(name: str, actual: str, expected: str, pinned_in: str = "gat/planetoid.sha256") -> None:
    """The one checksum check: ChecksumError naming `name` unless `actual` is the `expected` pinned in `pinned_in`."""
    if actual != expected:
        raise ChecksumError(f"{name}: SHA-256 is {actual}, but {expected} is pinned ({pinned_in}).")


def check_size(name: str, actual: int, expected: int) -> None:
    """ChecksumError naming `name` unless its `actual` size is the pinned `expected`: checked before hashing."""
    if actual != expected:
        raise ChecksumError(f"{name}: {actual:,} bytes, but {expected:,} are pinned (gat/planetoid.sizes).")


def verify_raw(raw: Mapping[str, bytes], expected: Mapping[str, str], where: str = "") -> None:
    """Check each file's bytes in `raw` against `expected` (file name -> SHA-256); `where` prefixes the names.

    Before unpickling: gat.data must only ever unpickle the pinned bytes.
    """
    for name, digest in expected.items():
        check_sha256(f"{where}{name}", hashlib.sha256(raw[name]).hexdigest(), digest)
