"""The fused kernel built several ways on this one machine: the stand-in for "another CPU, another compiler setting".

Each build (-O3 at the x86-64 levels v1 (SSE2), v2, v3 and v4 where the CPU has AVX-512, -march=native without the
default build's -mprefer-vector-width=512 (so at the vector width GCC tunes this CPU for), one with
AddressSanitizer and UndefinedBehaviorSanitizer, and one whose buffers grow with NaN, -DGAT_POISON_BUFFERS, where
the others leave whatever was there: a read before a write then fails) is compiled into a folder of its own by
`python -m tools.build_fused --fingerprint`, in a process of its own, which

- runs the build's self-check (gat.fused_check: forward, float32 and float64 gradients, validation and Adam steps
  against the torch path, on small random graphs), so every build passes the kernel's correctness checks;
- prints the SHA-256 of the float32 weights after a short training run, and of seeds trained as vector lanes at
  each lane width (4, 8, 16: per level, one vector of SSE, AVX2 or AVX-512, or several, or the plain-code widening
  of the masks at v1), so every width of every build must give the per-seed kernel's bytes;
- (but the sanitizers' build) computes exp in vector lanes (exp_approx, 8 and 16 lanes at the build's widths) on a
  sample of floats, each float's bytes as the array loop's (tests/test_fused.py runs every float on the default build).

With no fast-math and no FMA contraction, each operation rounds alike at every vector width, so every build must
give the same fingerprint as the default one, bit for bit. GCC 12.2 at -O3 -march=x86-64-v3 once failed the float64
check (the README's "The fused kernel"): this is the test that would have caught it here.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_fused import sampled_exp_lanes_mismatches

REPO = Path(__file__).resolve().parents[1]
COMPILER = shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")

# Seven compiler builds, each self-checked and trained: about 5 minutes; `make test-all` runs them.
pytestmark = pytest.mark.slow


def _cpu_flags() -> frozenset[str]:
    from gat.fused import cpu_facts

    facts = cpu_facts()
    return facts[1] if facts is not None else frozenset()


BUILDS = {
    "x86-64": ("-O3 -march=x86-64", {}),
    "x86-64-v2": ("-O3 -march=x86-64-v2", {}),
    "x86-64-v3": ("-O3 -march=x86-64-v3", {}),
    "x86-64-v4": ("-O3 -march=x86-64-v4", {}),
    "native": ("-O3 -march=native", {}),
    "poisoned-buffers": ("-O3 -march=native -DGAT_POISON_BUFFERS", {}),
    "sanitizers": ("-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all",
                   {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}),
}


def _needs(name: str) -> str | None:
    """Why this machine can't run the build `name`, or None."""
    if COMPILER is None:
        return "no C++ compiler"
    flags = _cpu_flags()
    if name == "x86-64-v3" and not {"avx2", "fma", "bmi2"} <= flags:
        return "the CPU has no AVX2"
    if name == "x86-64-v4" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "the CPU has no AVX-512"
    return None


def build_and_fingerprint(optimisation: str, folder: Path, extra_env: dict[str, str]) -> str:
    """Build with `optimisation` into `folder`, self-check it, return its fingerprint."""
    env = {**os.environ, "GAT_FUSED_DIR": str(folder), "GAT_FUSED_CXXFLAGS": optimisation, **extra_env}
    env.pop("GAT_FUSED_DISABLE", None)
    if "-fsanitize=address" in optimisation:
        # ASan's runtime must come first in the process: python is not built with it, so it is preloaded.
        runtime = subprocess.run([COMPILER or "g++", "-print-file-name=libasan.so"], capture_output=True,
                                 text=True).stdout.strip()
        env["LD_PRELOAD"] = runtime
    done = subprocess.run([sys.executable, "-m", "tools.build_fused", "--fingerprint"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "self-check passed" in done.stdout, (optimisation, done.stdout, done.stderr[-3000:])
    assert "runtime error" not in done.stderr and "ERROR: AddressSanitizer" not in done.stderr, done.stderr[-3000:]
    # The compiler's warnings and notes, which tools.build_fused shows: none at any level.
    assert not re.search(r"fused\.cpp:\d+:\d+: (warning|note):", done.stderr), (optimisation, done.stderr[-3000:])
    return done.stdout.split("fingerprint: ")[1].split()[0]


@pytest.fixture(scope="module")
def default_fingerprint() -> str:
    """The fingerprint of the build every stage uses (gat.fused.DEFAULT_OPTIMISATION, in the virtual environment)."""
    from gat import fused, fused_check

    reason = fused.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return fused_check.fingerprint(fused.library())


@pytest.mark.parametrize("name", BUILDS)
def test_every_build_passes_its_self_check_and_trains_the_same_bits(name: str, tmp_path: Path,
                                                                     default_fingerprint: str) -> None:
    missing = _needs(name)
    if missing:
        pytest.skip(missing)
    optimisation, extra_env = BUILDS[name]
    assert build_and_fingerprint(optimisation, tmp_path, extra_env) == default_fingerprint
    built = list(tmp_path.glob("gat_fused-*.so"))
    assert len(built) == 1  # and nothing else: no partial file, no rejection
    assert not list(tmp_path.glob("*.rejected")) and not list(tmp_path.glob("*.partial"))
    if "-fsanitize" not in optimisation:  # (the sanitizers' runtime would have to come first in this process)
        # exp in vector lanes at this build's widths (16 lanes as AVX-512, as two AVX2 vectors, or four SSE ones):
        # the test_fused sample of floats, each float's bytes as exp_inplace's.
        library = ctypes.CDLL(str(built[0]))
        assert sampled_exp_lanes_mismatches(library) == 0
