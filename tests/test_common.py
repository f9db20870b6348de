"""stages.support (params, files, interrupts): params.yaml read strictly, every problem one line; outputs written
atomically, together."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gat.config import Params, ParamsError
from stages.support.params import StageError, load_params

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_the_repository_params_load() -> None:
    # It repeats key names (lr, device, ...) in different mappings, which is fine.
    assert isinstance(load_params(REPO / "params.yaml"), Params)


def test_a_key_set_twice_is_refused_naming_it_and_both_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "train:\n  seed: 0\n  lr: 0.005\n  dataset: cora\n  lr: 0.01\n")
    with pytest.raises(StageError) as error:
        load_params(path)
    assert str(error.value) == f"{path}: `lr` is set twice in the same mapping, on lines 3 and 5; delete one of them."


def test_a_section_set_twice_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "download:\n  retries: 4\ndatasets: [cora]\ndownload: {retries: 0}\n")
    with pytest.raises(StageError, match=r"`download` is set twice in the same mapping, on lines 1 and 4"):
        load_params(path)


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    # `<<: *defaults` then a key of its own is YAML's way to override a default, not a duplicate:
    # the file gets as far as validation, which refuses the unknown sections.
    path = _write(tmp_path, "defaults: &defaults {lr: 0.005}\nmine:\n  <<: *defaults\n  lr: 0.01\n")
    with pytest.raises(ParamsError, match="is not a known key"):
        load_params(path)


def test_invalid_yaml_is_one_line_with_its_line_number(tmp_path: Path) -> None:
    path = _write(tmp_path, "datasets: [cora]\nbroken: [1, 2\nnext: 3\n")
    with pytest.raises(StageError) as error:
        load_params(path)
    assert re.fullmatch(rf"{re.escape(str(path))} line 3 is not valid YAML: expected ',' or '\]', but got ':'; "
                        "fix it there\\.", str(error.value))


def test_a_stop_during_the_output_writes_waits_until_all_are_written(tmp_path: Path) -> None:
    """SIGTERM while a stage writes its outputs acts only once all of them are there: none is left half-new.

    In a process of its own, as a stage runs: main() installs the stop handlers for good once a stop came.
    """
    import subprocess
    import sys

    script = tmp_path / "stage.py"
    script.write_text(
        "import os, signal, sys, threading, time\n"
        "from pathlib import Path\n"
        "from stages.support.files import outputs_together, write_json\n"
        "from stages.support.interrupts import main\n"
        "out = Path(sys.argv[1])\n"
        "def run():\n"
        "    # another thread, as MLflow and tqdm start: the kernel may hand it the signal\n"
        "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "    with outputs_together():\n"
        "        write_json(out / 'a.json', {'a': 1})\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # to the process, as dvc sends it\n"
        "        write_json(out / 'b.json', {'b': 2})\n"
        "    write_json(out / 'after.json', {})\n"
        "main(run)\n")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})  # the project as installed
    assert done.returncode == 128 + 15, done.stderr
    assert "interrupted by SIGTERM" in done.stderr
    assert sorted(path.name for path in tmp_path.glob("*.json")) == ["a.json", "b.json"]


def test_outputs_written_together_are_all_new_or_none(tmp_path: Path) -> None:
    """A failure after some outputs are written leaves none of them, and no temporary file."""
    from stages.support.files import outputs_together, write_atomic, write_json

    (tmp_path / "a.json").write_text("old")
    with pytest.raises(RuntimeError):
        with outputs_together():
            write_json(tmp_path / "a.json", {"a": 1})
            write_atomic(tmp_path / "b.txt", "new")
            raise RuntimeError("the third output failed")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.json"]
    assert (tmp_path / "a.json").read_text() == "old"
    with outputs_together():
        write_json(tmp_path / "a.json", {"a": 1})
        write_atomic(tmp_path / "b.txt", "new")
        assert (tmp_path / "a.json").read_text() == "old"  # renamed only once every one is written
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.json", "b.txt"]
    assert (tmp_path / "a.json").read_text() == '{\n  "a": 1\n}\n'


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import tempfile

    import stages.support.files as common

    real = tempfile.NamedTemporaryFile

    def full(*args, **kwargs):
        handle = real(*args, **kwargs)

        def write(data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        handle.write = write
        return handle

    monkeypatch.setattr(common.tempfile, "NamedTemporaryFile", full)
    with pytest.raises(StageError, match=re.escape(f"no space left on the device that holds {tmp_path}: free some "
                                                   f"space there (`df -h {tmp_path}`), then rerun")):
        common.write_atomic(tmp_path / "model.pt", b"weights")
    assert list(tmp_path.iterdir()) == []


def test_a_float_without_a_dot_reads_as_dvc_reads_it(tmp_path: Path) -> None:
    """`lr: 5e-3` is a number to DVC (YAML 1.2); PyYAML alone would read the string '5e-3' and refuse it."""
    from stages.support.params import parse_params_yaml

    assert parse_params_yaml("lr: 5e-3\nbig: 1E9\nepochs: 5\nname: e5") == {"lr": 0.005, "big": 1e9, "epochs": 5,
                                                                           "name": "e5"}
    text = (REPO / "params.yaml").read_text()
    # The paper's lr, which train merges from x-paper-protocol.
    paper_lr = re.search(r"^x-paper-protocol:.*\n(?:  .*\n)*?    lr: 0\.005\n", text, re.MULTILINE)
    assert paper_lr is not None
    changed = text[:paper_lr.end()].replace("lr: 0.005\n", "lr: 7e-3\n") + text[paper_lr.end():]
    assert load_params(_write(tmp_path, changed)).train.optim.lr == 0.007


# The params a stage logs ---------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_each_stage_logs_its_dvc_params_with_params_yaml_keys() -> None:
    """logged_params keeps the keys each stage logged before it existed, so the UI's columns still line up."""
    from gat.config import flatten
    from stages.support.tracking import logged_params

    params = load_params(REPO / "params.yaml")
    assert logged_params(params, "download", "cora") == flatten(params.download, "download")
    assert logged_params(params, "preprocess", "cora") == flatten(params.preprocess, "preprocess")
    assert logged_params(params, "train") == flatten({"datasets": params.datasets, "download": params.download,
                                                      "preprocess": params.preprocess, "train": params.train})
    settings = params.reproduce
    assert logged_params(params, "reproduce", "citeseer") == {
        **flatten({k: v for k, v in vars(settings).items() if k != "protocol"}, "reproduce"),
        **flatten(settings.protocol["citeseer"], "reproduce.protocol.citeseer")}
    assert "train.optim.lr" in logged_params(params, "train")


def test_logged_params_cover_what_dvc_yaml_tracks() -> None:
    """Every params.yaml key a stage depends on (dvc.yaml's `params`) is logged by the stage that logs params."""
    import yaml

    from stages.support.tracking import STAGE_PARAMS, logged_params

    params = load_params(REPO / "params.yaml")
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name in STAGE_PARAMS.keys() & stages.keys():  # the ablation is no DVC stage
        tracked = (stages[name].get("do") or stages[name]).get("params", [])
        for dataset in ("cora", "cora_npz"):  # a Planetoid dataset, and an npz graph of `graphs`
            keys = logged_params(params, name, dataset)
            for entry in tracked:
                entry = entry.replace("${item}", dataset)
                if entry == "graphs":  # DVC tracks the whole section; a stage logs its own graph's block, if any
                    entry = f"graphs.{dataset}"
                    if dataset not in params.graphs:
                        continue
                assert any(key == entry or key.startswith(f"{entry}.") for key in keys), (name, entry)


def test_logged_params_never_carry_a_password(tmp_path: Path) -> None:
    import yaml

    from stages.support.tracking import describe_run, logged_params

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["download"]["base_url"] = "https://user:secret@mirror.example/planetoid"
    params = Params.from_dict(raw)
    for stage in ("download", "train"):
        assert logged_params(params, stage)["download.base_url"] == "https://user:***@mirror.example/planetoid"
    assert "secret" not in describe_run("a run", logged_params(params, "train"))
