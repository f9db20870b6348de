"""The README's pictures and figures are what the committed dvc.lock produces, so they cannot go stale.

- Always: every picture the README shows is in `reports/figures/`, has the bytes (md5) that the committed
  `dvc.lock` records for the same file under `data/analysis/`, and the pixel size the README's table gives.
- With the real Cora (`../shared`), end to end: `dvc repro analyze` with the committed `params.yaml` in a copy
  of the project gives the outputs `dvc.lock` records, and the numbers the README prints (the metrics table,
  the attention entropies, the silhouettes) are those outputs' numbers.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import yaml
from conftest import PlanetoidFolder
from pipeline_support import REPO, Pipeline, clean_env, copy_project

README = (REPO / "README.md").read_text()
FIGURES = REPO / "reports" / "figures"


def locked_outputs() -> dict[str, str]:
    """path -> md5 of every output the committed dvc.lock records."""
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


ABLATION_PICTURE = REPO / "reports" / "ablation.png"  # `make ablation`'s, not analyze's: tests/test_readme_ablation.py


def readme_pictures() -> list[Path]:
    """The files of the README's `![...](path)` images of the analyze stage (all but the ablation's)."""
    return [REPO / path for path in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", README)
            if REPO / path != ABLATION_PICTURE]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk: the 8-byte signature, then length, type, width, height."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_every_readme_picture_is_the_locked_analyze_output() -> None:
    pictures, locked = readme_pictures(), locked_outputs()
    assert {picture.parent for picture in pictures} == {FIGURES} and len(pictures) >= 5
    assert sorted(FIGURES.glob("*.png")) == sorted(pictures), "a picture in reports/figures/ the README doesn't show"
    for picture in pictures:
        output = f"data/analysis/{picture.name}"
        assert output in locked, f"{picture.name}: no such output of analyze in dvc.lock"
        assert md5(picture) == locked[output], (
            f"reports/figures/{picture.name} is not what dvc.lock's analyze produced: run `make figures`")


def test_the_readme_gives_each_picture_its_real_size() -> None:
    """The table's `name.png` (W×H) entries against the PNG headers."""
    sizes = re.findall(r"`(\w+\.png)` \((\d+)×(\d+)\)", README)
    assert {name for name, _, _ in sizes} == {picture.name for picture in readme_pictures()}
    for name, width, height in sizes:
        assert png_size(FIGURES / name) == (int(width), int(height)), name


def readme_metrics_table() -> dict[str, float]:
    """The Results section's `dvc metrics show --md data/eval/metrics.json` table, column -> value."""
    section = README.split("## Results", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| data/eval/metrics.json")]
    header = next(line for line in section.splitlines() if line.startswith("| Path"))
    names = [cell.strip() for cell in header.strip("|").split("|")][1:]
    values = [cell.strip() for cell in rows[0].strip("|").split("|")][1:]
    return {name: float(value) for name, value in zip(names, values, strict=True)}


def readme_analysis_figures() -> dict[str, float]:
    """The numbers of "What this shows about Cora", by the analyze metric they quote."""
    entropy = re.search(r"mean\s+entropy is ([\d.]+) nats in layer 1 and ([\d.]+) in layer 2, against ([\d.]+) for "
                        r"uniform", README)
    silhouette = re.search(r"silhouette ([\d.]+) in 64 dimensions, ([\d.]+) in the t-SNE map", README)
    assert entropy and silhouette, "the README's analysis paragraph changed: update this test"
    keys = ("attention_entropy_layer1", "attention_entropy_layer2", "attention_entropy_uniform",
            "silhouette_layer1", "silhouette_tsne")
    return dict(zip(keys, map(float, entropy.groups() + silhouette.groups()), strict=True))


def quoted(value: float, shown: float) -> bool:
    """`shown` is `value` as the README prints it: rounded to the digits it has (DVC prints at most 5 decimals)."""
    decimals = len(repr(shown).split(".")[1]) if "." in repr(shown) else 0
    return round(value, decimals) == shown


@pytest.mark.slow
def test_the_committed_params_reproduce_the_readme(tmp_path: Path, planetoid_folder: PlanetoidFolder,
                                                   planetoid_server: str) -> None:
    """The default pipeline up to analyze, from scratch: its outputs are dvc.lock's, its numbers the README's."""
    if not planetoid_folder.real:
        pytest.skip("needs the real Cora (../shared/datasets/planetoid): the README's figures are Cora's")
    copy_project(tmp_path, planetoid_folder)  # the committed params.yaml, unchanged; no dvc.lock
    pipeline = Pipeline(tmp_path, clean_env() | {"GAT_DATA_MIRROR": planetoid_server})
    pipeline.run("git", "init", "-q", "-b", "main")
    pipeline.commit("copy of the project under test")
    pipeline.dvc("repro", "analyze")

    locked = locked_outputs()
    produced = [path for path in locked if path.startswith(("data/eval/", "data/analysis/", "data/train/model.pt"))]
    assert len(produced) >= 9
    differ = [path for path in produced if md5(tmp_path / path) != locked[path]]
    assert not differ, f"the committed dvc.lock is not what the committed params produce: {differ}"

    evaluation = json.loads((tmp_path / "data/eval/metrics.json").read_text())
    table = readme_metrics_table()
    assert table.keys() == evaluation.keys()
    wrong = {key: (shown, evaluation[key]) for key, shown in table.items() if not quoted(evaluation[key], shown)}
    assert not wrong, f"README Results table (shown, real): {wrong}"

    analysis = json.loads((tmp_path / "data/analysis/metrics.json").read_text())
    wrong = {key: (shown, analysis[key]) for key, shown in readme_analysis_figures().items()
             if not quoted(analysis[key], shown)}
    assert not wrong, f"README analysis paragraph (shown, real): {wrong}"
    assert f"restored epoch {evaluation['best_epoch']}, test accuracy {evaluation['test_acc']}" in " ".join(
        README.split())
