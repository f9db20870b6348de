"""Build the fused CPU kernel (gat/csrc/fused.cpp) and self-check it against the torch path: what `make` runs.

The library goes where gat.fused looks for it (gat.fused.library_path: `<sys.prefix>/gat-fused/`, or
`$GAT_FUSED_DIR`, one file per source, self-check, flags, compiler and CPU). It is compiled under a temporary name,
loaded and compared with the torch path on small random graphs (gat.fused_check) on the machine that built it, and
only then renamed into place with the SHA-256 of its checked bytes beside it: processes building at once never
load half a file, and nothing finds a build that has not passed its check. A build that disagrees is recorded as
rejected, with the difference, so that it is neither used nor rebuilt.

Exits 0 once the library is there (built now or before), else 1 with one line saying why: `make` then leaves no
stamp, and `kernel: fused` trains with the torch kernel and says so.

    python -m tools.build_fused                 # build (or find) the library; says why when it cannot
    python -m tools.build_fused --fingerprint   # and the weights' hash after a short run (same on every build)
    GAT_FUSED_CXXFLAGS="-O3 -march=x86-64-v3" python -m tools.build_fused   # another optimisation or CPU level
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from gat import fused
from gat.fused import FusedUnavailable


def build(verbose: bool = False) -> Path:
    """The library for the current source, compiled and self-checked unless it is there already.

    Raises FusedUnavailable: building is disabled or impossible here, or the build failed its self-check (now or
    before).
    """
    if os.environ.get("GAT_FUSED_DISABLE"):
        raise FusedUnavailable("GAT_FUSED_DISABLE is set")
    compiler = fused.compiler()
    if compiler is None:
        raise FusedUnavailable("no C++ compiler ($CXX, g++ or c++) on PATH; install g++ to build it")
    path = fused.library_path(compiler)
    if fused.rejection_file(path).is_file():
        raise FusedUnavailable(fused.rejection_file(path).read_text().strip())
    if path.is_file() and fused.digest_file(path).is_file():
        return path
    try:
        return compile_and_check(compiler, path, verbose)
    except OSError as error:  # a read-only or full build folder
        raise FusedUnavailable(f"cannot write the build into {path.parent} ({error.strerror or error}); set "
                               "GAT_FUSED_DIR to a writable folder") from None


def compile_and_check(compiler: str, path: Path, verbose: bool) -> Path:
    """Compile fused.cpp into `path` and keep it only if it passes gat.fused_check. Raises FusedUnavailable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=path.stem, suffix=".so.partial", dir=path.parent)
    os.close(fd)
    try:
        command = fused.compile_command(compiler, fused.SOURCE, partial)
        if verbose:
            print(" ".join(command), file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise FusedUnavailable(f"{compiler} failed to compile {fused.SOURCE.name} (exit {done.returncode}): "
                                   f"{first}")
        if verbose and done.stderr.strip():
            print(done.stderr.rstrip(), file=sys.stderr)  # the compiler's warnings, as any build shows them
        from gat import fused_check

        difference = fused_check.disagreement(fused.load(Path(partial)))
        if difference is not None:
            chosen = " ".join(fused.cxxflags()[:-len(fused.SEMANTIC_FLAGS)])
            reason = (f"the build {path.name} ({chosen}) failed its self-check against the torch "
                      f"path: {difference}; rebuild with GAT_FUSED_CXXFLAGS=-O2 or another compiler")
            write_atomically(fused.rejection_file(path), reason + "\n")
            raise FusedUnavailable(reason)
        # The checked bytes' hash first, then the library: a library without its hash is never loaded.
        write_atomically(fused.digest_file(path), fused.sha256_of(Path(partial)) + "\n")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def write_atomically(path: Path, text: str) -> None:
    fd, partial = tempfile.mkstemp(prefix=path.name, suffix=".partial", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.build_fused", description=__doc__.split("\n")[0])
    parser.add_argument("--fingerprint", action="store_true",
                        help="then print the SHA-256 of the float32 weights after a short training run: the same on "
                             "every build, CPU and optimisation level")
    arguments = parser.parse_args(argv)
    try:
        path = build(verbose=True)
        lib = fused.load(fused.verified(path))
    except FusedUnavailable as error:
        # make leaves no stamp (and tries again next time); training falls back to the torch kernel and says so.
        print(f"tools.build_fused: not built ({error}); `kernel: fused` will train with the torch kernel",
              file=sys.stderr)
        sys.exit(1)
    print(f"tools.build_fused: {path} (self-check passed)")
    if arguments.fingerprint:
        from gat import fused_check

        print(f"fingerprint: {fused_check.fingerprint(lib)}")


if __name__ == "__main__":
    main()
