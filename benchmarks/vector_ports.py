"""What one core's vector units do per nanosecond, and the fused kernel's sparse product beside that floor.

    python -m benchmarks.vector_ports [--repeats 5]

benchmarks/csrc/vector_ports.cpp is compiled as `make` builds the kernel (the same compiler and flags, so the same
vector width), with gat/csrc/fused.cpp included: the product it times is the kernel's own `sparse_row_product`.

It prints, on one thread:
- the vector instructions a nanosecond: 8 and 16 lanes of float, adds, multiplies, and the two alternating, each in
  12 independent chains; and one chain of dependent adds, whose rate is 1 / their latency;
- the first layer's `x·W` (64 outputs a stored feature, as Cora's 8 heads of 8), nanoseconds per stored feature, on
  2,708 rows of 9 to 27 stored features: with the rows of W gathered from 1,433 features (Cora's 358 KB W, which
  the L1 cache does not hold), from 8 (2 KB, always in L1), and under the step's input dropout;
- the same under dropout through lists of what each pair of heads keeps (AVX-512 only): a stored feature whose two
  heads of a pair are both dropped (36 % at the paper's rates) adds +0 to that pair's sums, so a list per pair that
  skips it gives the same bytes; the time to build the lists (again each step, as the masks are new), the product
  over them, and whether its bytes are the kernel's;
- its floor: a stored feature's 64 multiplies and 64 adds at the alternating rate of the widest vectors.

The kernel may not contract a multiply and an add into one FMA (`-ffp-contract=off`, torch's rounding), so
alternating adds and multiplies is the arithmetic it runs. A CPU whose adds and multiplies share their ports shows
the same rate for both alone and alternating. Nothing is written in the repository.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.kernel_ab import build_aside
from gat import fused
from stages.support.params import StageError

SOURCE = Path(__file__).with_name("csrc") / "vector_ports.cpp"
CORA_ROWS = 2708
CORA_FEATURES = 1433
L1_FEATURES = 8  # W of 8 rows: 2 KB
OUTPUTS = 64  # the first layer's 8 heads × 8 features
SEED = 22


@dataclass(frozen=True)
class Rates:
    """Vector instructions per nanosecond; `wide_*` are 0 without AVX-512."""

    adds: float
    multiplies: float
    alternating: float
    wide_adds: float
    wide_multiplies: float
    wide_alternating: float
    dependent_adds: float

    def lane_operations(self) -> float:
        """Float operations per nanosecond, adds and multiplies alternating, at the widest vectors."""
        return max(8 * self.alternating, 16 * self.wide_alternating)


@dataclass(frozen=True)
class SparseProduct:
    """Nanoseconds per stored feature of the kernel's x·W."""

    gathered: float  # rows of W from CORA_FEATURES features
    in_l1: float  # rows of W from L1_FEATURES features
    under_dropout: float  # gathered, with the step's input dropout


@dataclass(frozen=True)
class KeptPairs:
    """The step's x·W through per-pair lists of what is kept: nanoseconds per stored feature; all 0 without
    AVX-512."""

    build: float  # the lists, from the step's masks
    product: float  # the product over them
    kept_share: float  # of (stored feature, pair of heads)
    same_bytes: bool  # as the kernel's product

    @property
    def built(self) -> bool:
        return self.product > 0


def build(folder: Path) -> Any:
    """vector_ports.cpp built into `folder` with the kernel's flags, loaded and typed."""
    library = build_aside(SOURCE, folder / "vector_ports.so", ("-I", str(fused.SOURCE.parent)),
                          "benchmarks/csrc/vector_ports.cpp")
    lib = ctypes.CDLL(str(library))
    lib.vp_rates.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.vp_rates.restype = None
    lib.vp_sparse_product.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
    lib.vp_sparse_product.restype = ctypes.c_double
    lib.vp_kept_pairs_product.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64,
                                          ctypes.POINTER(ctypes.c_double)]
    lib.vp_kept_pairs_product.restype = None
    return lib


def rates(lib: Any, iterations: int, repeats: int) -> Rates:
    measured = (ctypes.c_double * 7)()
    lib.vp_rates(iterations, repeats, measured)
    return Rates(*measured)


def sparse_product(lib: Any, rows: int, repeats: int) -> SparseProduct:
    return SparseProduct(gathered=lib.vp_sparse_product(rows, CORA_FEATURES, 0, repeats, SEED),
                         in_l1=lib.vp_sparse_product(rows, L1_FEATURES, 0, repeats, SEED),
                         under_dropout=lib.vp_sparse_product(rows, CORA_FEATURES, 1, repeats, SEED))


def kept_pairs(lib: Any, rows: int, repeats: int) -> KeptPairs:
    measured = (ctypes.c_double * 4)()
    lib.vp_kept_pairs_product(rows, CORA_FEATURES, repeats, SEED, measured)
    return KeptPairs(build=measured[0], product=measured[1], kept_share=measured[2], same_bytes=measured[3] == 1)


def floor_ns(measured: Rates) -> float:
    """A stored feature's OUTPUTS multiplies and OUTPUTS adds at the alternating rate: nanoseconds."""
    return 2 * OUTPUTS / measured.lane_operations()


def report(measured: Rates, product: SparseProduct, kept: KeptPairs) -> list[str]:
    def row(lanes: int, adds: float, multiplies: float, alternating: float) -> str:
        return (f"  {lanes} lanes: adds {adds:.2f}, multiplies {multiplies:.2f}, alternating {alternating:.2f} "
                f"({alternating * lanes:.0f} float operations)")

    lines = ["vector instructions per ns, one thread, 12 independent chains:",
             row(8, measured.adds, measured.multiplies, measured.alternating)]
    if measured.wide_alternating > 0:
        lines.append(row(16, measured.wide_adds, measured.wide_multiplies, measured.wide_alternating))
    else:
        lines.append("  16 lanes: not built (no AVX-512 in these flags)")
    floor = floor_ns(measured)
    lines += [f"  one chain of dependent 8-lane adds: {measured.dependent_adds:.2f} per ns "
              f"(latency {1 / measured.dependent_adds:.3f} ns)",
              f"the kernel's x·W ({OUTPUTS} outputs), ns per stored feature, {CORA_ROWS:,} rows of 9 to 27:",
              f"  rows of W from {CORA_FEATURES:,} features ({CORA_FEATURES * OUTPUTS * 4 // 1024} KB): "
              f"{product.gathered:.2f} ({product.gathered / floor:.2f}× the floor)",
              f"  rows of W from {L1_FEATURES} features (in L1): {product.in_l1:.2f} "
              f"({product.in_l1 / floor:.2f}× the floor)",
              f"  from {CORA_FEATURES:,} features, under the step's input dropout: {product.under_dropout:.2f} "
              f"({product.under_dropout / floor:.2f}× the floor)"]
    if kept.built:
        lines += [f"  the same through per-pair lists of what is kept ({kept.kept_share:.0%} of the pairs of heads): "
                  f"the lists {kept.build:.2f} + the product {kept.product:.2f} = {kept.build + kept.product:.2f} "
                  f"({(kept.build + kept.product) / product.under_dropout:.2f}× the kernel's), "
                  f"{'the same bytes' if kept.same_bytes else 'other bytes than the kernel'}"]
    else:
        lines += ["  the same through per-pair lists of what is kept: not built (no AVX-512 in these flags)"]
    lines.append(f"  the floor, {OUTPUTS} multiplies and {OUTPUTS} adds at {measured.lane_operations():.0f} "
                 f"float operations per ns: {floor:.2f}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timings of each measurement; the fastest counts")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        sys.exit(2)
    try:
        with tempfile.TemporaryDirectory(prefix="gat-vector-ports-") as folder:
            lib = build(Path(folder))
            lines = report(rates(lib, 20_000_000, args.repeats), sparse_product(lib, CORA_ROWS, 40 * args.repeats),
                           kept_pairs(lib, CORA_ROWS, 40 * args.repeats))
    except StageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
