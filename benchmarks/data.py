"""Where the benchmarks find Cora and the model they time: the raw files, checked, and the paper's protocol.

The protocol (model and optimiser) is read from params.yaml's `reproduce.protocol.cora`, where it is written
once; the files' names and pinned checksums come from the dataset registry, gat.datasets.
"""

from __future__ import annotations

import functools
from pathlib import Path

from gat.config import Setup
from gat.data import Graph, parse_planetoid
from gat.datasets import DATASETS, ChecksumError, verify_raw
from stages.support.params import StageError, load_params

REPO_ROOT = Path(__file__).resolve().parents[1]
# The dataset the benchmarks run on.
DATASET = "cora"
# Where the raw files are looked for without --data-dir, in this order: the machines' shared copy,
# then the download stage's output (`make repro`).
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "datasets" / "planetoid"
DOWNLOADED_DATA_DIR = REPO_ROOT / "data" / "raw" / DATASET


@functools.cache
def protocol() -> Setup:
    """The paper's model and optimiser for DATASET, as params.yaml sets them for the reproduce stage."""
    return load_params(REPO_ROOT / "params.yaml").reproduce.protocol[DATASET]


def default_data_dir() -> Path:
    """SHARED_DATA_DIR when it exists, else DOWNLOADED_DATA_DIR; failing both, say how to get the files."""
    for folder in (SHARED_DATA_DIR, DOWNLOADED_DATA_DIR):
        if folder.is_dir():
            return folder
    raise StageError(f"no Cora files: neither {SHARED_DATA_DIR} nor {DOWNLOADED_DATA_DIR} exists; run `make repro` "
                     "first (it downloads them there) or pass --data-dir FOLDER")


def read_raw(folder: Path, dataset: str = DATASET, verify: bool = True) -> dict[str, bytes]:
    """The eight raw `ind.<dataset>.*` files' bytes, checked against gat/planetoid.sha256 when `verify`."""
    folder = Path(folder)
    names = DATASETS[dataset].file_names
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise StageError(f"{folder} does not hold the Planetoid files {', '.join(missing)}: pass "
                         f"--data-dir FOLDER, a folder with the eight ind.{dataset}.* files")
    raw = {name: (folder / name).read_bytes() for name in names}
    if verify:
        try:
            verify_raw(raw, DATASETS[dataset].checksums(), where=f"{folder}/")
        except ChecksumError as error:
            raise StageError(f"{error} The file was changed or comes from elsewhere: run "
                             f"`dvc repro --force download@{dataset}` to download it again.") from None
    return raw


def load_graph(folder: Path, dataset: str = DATASET, verify: bool = True) -> Graph:
    """Cora (or another Planetoid dataset) with the standard split, parsed by the project's own loader."""
    return parse_planetoid(read_raw(folder, dataset, verify), dataset)
