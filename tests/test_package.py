"""pyproject.toml: the project is installed into the venv, so its python imports every room from any folder."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import gat

REPO_ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("gat", "gat.seeds", "gat.dense_reference", "stages.train", "stages.reproduce", "stages.support.store",
         "tools.compare", "tools.init_store", "tools.ui", "tools.serve", "tools.exps", "team", "benchmarks.scale")


def test_the_project_is_an_installed_distribution() -> None:
    distribution = importlib.metadata.distribution("gat-repro")
    assert distribution.version == "0.1.0"
    assert distribution.read_text("direct_url.json") is not None  # installed by pip from this checkout


def test_the_venvs_python_imports_every_room_from_another_folder_without_pythonpath(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    program = ("import importlib, sys\n"
               f"for name in {ROOMS!r}:\n"
               "    importlib.import_module(name)\n"
               "import gat\n"
               "print(gat.__file__)\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    # The editable install points at this checkout: the tests' code and the workers' code are the same files.
    assert Path(result.stdout.strip()) == Path(gat.__file__).resolve() == REPO_ROOT / "gat" / "__init__.py"

