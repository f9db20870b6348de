"""The same outputs on every CPU: the real pipeline under two torch CPU capabilities, and a colleague's clone.

torch's `ATEN_CPU_CAPABILITY` picks its vector kernels (`default`: scalar code; `avx2`), and numpy's
`NPY_DISABLE_CPU_FEATURES` switches off its AVX2/AVX-512 dispatch targets, `MKL_ENABLE_INSTRUCTIONS` caps
MKL's: together they stand in, on one machine, for a colleague's other CPU. Every file DVC caches must come
out the same bytes either way.

`data/train/run.json` is the one exception, by design: it names the MLflow run (and model) that the train
stage logged, a fresh id on every run. It is compared without those ids.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pipeline_support import Pipeline, ran

# The identity of the MLflow run a training wrote: new on every run, whatever the CPU.
RUN_IDS = {"run_id", "experiment_id", "model_uri"}
RUN_JSON = "data/train/run.json"


def numpy_dispatch_off() -> str:
    """NPY_DISABLE_CPU_FEATURES that leaves numpy its baseline code only (no AVX2, no AVX-512 loops)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__

    return " ".join(__cpu_dispatch__)


# A CPU with AVX2 (any x86-64 of the last ten years), and one seen through scalar torch, baseline numpy and
# MKL's AVX2 code (what it runs on CPUs without AVX-512, and on AMD's); OpenBLAS's choice is left alone.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2"}
SCALAR = {"ATEN_CPU_CAPABILITY": "default", "NPY_DISABLE_CPU_FEATURES": numpy_dispatch_off(),
          "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def under(pipeline: Pipeline, env: dict[str, str]) -> Pipeline:
    """The same checkout, its commands run under `env` besides its own."""
    return Pipeline(pipeline.root, pipeline.env | env)


def outputs(root: Path) -> dict[str, str]:
    """Every output dvc.lock records, path -> md5 (a folder's ends in .dir)."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


def assert_same_outputs(ours: Path, theirs: Path) -> None:
    mine, other = outputs(ours), outputs(theirs)
    assert len(mine) > 15 and mine.keys() == other.keys()
    differ = sorted(path for path in mine if path != RUN_JSON and mine[path] != other[path])
    assert not differ, f"outputs that depend on the CPU: {differ}"
    runs = [{key: value for key, value in json.loads((root / RUN_JSON).read_text()).items() if key not in RUN_IDS}
            for root in (ours, theirs)]
    assert runs[0] == runs[1] and "best_epoch" in runs[0]


def probe_capability(pipeline: Pipeline) -> str:
    return pipeline.python("-c", "import torch; print(torch.backends.cpu.get_cpu_capability())").stdout.strip()


@pytest.fixture(scope="module")
def on_avx2(pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    """A copy of the finished pipeline, every stage rerun (`dvc repro -f`) under torch's AVX2 kernels."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    copy = under(pipeline.copy_to(tmp_path_factory.mktemp("avx2") / "gat-repro"), AVX2)
    assert probe_capability(copy) == "AVX2"
    copy.dvc("repro", "-f")
    copy.commit("the pipeline under ATEN_CPU_CAPABILITY=avx2")
    return copy


def test_every_output_is_the_same_bytes_under_scalar_and_avx2_kernels(on_avx2: Pipeline, pipeline_copy: Pipeline
                                                                      ) -> None:
    scalar = under(pipeline_copy, SCALAR)
    assert probe_capability(scalar) == "DEFAULT"
    assert "X86_V3" not in scalar.python("-c", "from numpy._core._multiarray_umath import __cpu_features__ as f; "
                                               "print([k for k, v in f.items() if v])").stdout
    done = scalar.dvc("repro", "-f")
    assert {"train", "evaluate", "analyze", "reproduce@cora"} <= set(ran(done))
    assert_same_outputs(on_avx2.root, scalar.root)


def test_a_colleague_on_another_cpu_pulls_the_outputs_and_reproduces_them(on_avx2: Pipeline, tmp_path: Path
                                                                          ) -> None:
    # Clone A (on_avx2) publishes its outputs to a DVC remote and its dvc.lock to git.
    remote = tmp_path / "remote"
    publisher = on_avx2.copy_to(tmp_path / "a")
    publisher.dvc("remote", "add", "-d", "store", str(remote))
    publisher.commit("a DVC remote")
    publisher.dvc("push")

    # Clone B: a git clone, so nothing but what git and the remote hold; torch's scalar kernels, baseline numpy.
    subprocess.run(["git", "clone", "-q", str(publisher.root), str(tmp_path / "b")], check=True, capture_output=True)
    colleague = Pipeline(tmp_path / "b", on_avx2.env | SCALAR)
    assert not (colleague.root / "data").exists()
    pulled = colleague.dvc("pull")
    assert "failed" not in (pulled.stdout + pulled.stderr).lower()
    status = colleague.dvc("status")
    assert "Data and pipelines are up to date" in status.stdout, status.stdout
    again = colleague.dvc("repro")
    assert ran(again) == [] and "Data and pipelines are up to date" in again.stdout, again.stdout
    for path in outputs(publisher.root):
        assert (colleague.root / path).exists(), path

    # Rerunning every stage there gives the same outputs, so the same hashes in dvc.lock.
    assert probe_capability(colleague) == "DEFAULT"
    colleague.dvc("repro", "-f")
    assert_same_outputs(publisher.root, colleague.root)
    changed = colleague.run("git", "diff", "--name-only").stdout.split()
    assert changed in ([], ["dvc.lock"])  # dvc.lock: only the new run id's hash of run.json
