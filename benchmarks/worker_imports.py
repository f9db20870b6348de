"""What a reproduce worker costs before its first job, with and without the stage's main module imported in it.

    python -m benchmarks.worker_imports [--rounds 3]

This module imports `stages.reproduce` first, as `python -m stages.reproduce` has when its workers start. Then, for
each pool the stage can use (`local`: stages.support.local_pool; `dask`: a LocalCluster, stages.support.dask_pool)
it starts one worker as the stage does ("hidden": stages.support.main_module keeps the main module out of it) and
one as plain "spawn" would ("imported": main_module_hidden made a no-op), and asks each, in its first job, for its
RSS, its CPU time since it started, and whether it imported MLflow. Prints the median [min-max] of `--rounds`
rounds per case.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from typing import Callable, Iterator, Sequence

import psutil

# As the main module (and in a worker that imports the main module again, as __mp_main__): what
# `python -m stages.reproduce` has imported as its workers start. Not under this module's own name, which is how
# the workers import worker_facts.
if __name__ in ("__main__", "__mp_main__"):
    import stages.reproduce  # noqa: F401


def worker_facts(_job: object = None) -> tuple[float, float, bool]:
    """(RSS in MB, CPU seconds since the process started, whether MLflow is imported), in the worker."""
    me = psutil.Process()
    times = me.cpu_times()
    return me.memory_info().rss / 2**20, times.user + times.system, "mlflow" in sys.modules


@contextlib.contextmanager
def _main_module(hidden: bool, *modules: object) -> Iterator[None]:
    """`main_module_hidden` as the pools have it, or a no-op in its place (plain "spawn")."""
    if hidden:
        yield
        return
    originals = [vars(module)["main_module_hidden"] for module in modules]
    for module in modules:
        vars(module)["main_module_hidden"] = contextlib.nullcontext
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            vars(module)["main_module_hidden"] = original


def _first_job(pool_kind: str, job: Callable[[object], tuple[float, float, bool]]) -> tuple[float, float, bool]:
    from stages.support import dask_pool, local_pool

    if pool_kind == "local":
        with local_pool.worker_pool(1) as pool:
            return next(pool.map(job, [None]))
    with dask_pool.dask_pool(1) as cluster:
        return cluster.client.submit(job, pure=False).result()


def measure(rounds: int) -> dict[tuple[str, str], list[tuple[float, float, bool]]]:
    """Per (pool kind, case), each round's worker_facts; the cases take turns within each round."""
    os.environ.setdefault("GAT_DASK_DASHBOARD", "off")
    os.environ.pop("DASK_SCHEDULER_ADDRESS", None)
    # The job under its importable name: run as `python -m`, this module's own worker_facts is __main__'s, for which
    # the local pool's workers would need the main module.
    from benchmarks.worker_imports import worker_facts as job
    from stages.support import dask_pool, local_pool

    samples: dict[tuple[str, str], list[tuple[float, float, bool]]] = {}
    for _ in range(rounds):
        for pool_kind in ("local", "dask"):
            for case in ("hidden", "imported"):
                with _main_module(case == "hidden", dask_pool, local_pool):
                    samples.setdefault((pool_kind, case), []).append(_first_job(pool_kind, job))
    return samples


def summary(samples: dict[tuple[str, str], list[tuple[float, float, bool]]]) -> list[str]:
    lines = []
    for (pool_kind, case), rounds in samples.items():
        rss, cpu, mlflow = zip(*rounds)
        lines.append(f"{pool_kind:5s} main module {case:8s}: RSS {statistics.median(rss):.0f} "
                     f"[{min(rss):.0f}-{max(rss):.0f}] MB, CPU {statistics.median(cpu):.2f} "
                     f"[{min(cpu):.2f}-{max(cpu):.2f}] s, MLflow imported: {' '.join(sorted(map(str, set(mlflow))))}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="workers started per pool kind and case")
    args = parser.parse_args(argv)
    # Here, not at the top: a worker imports this module for worker_facts, and should import no more than it needs.
    from stages.support import interrupts
    from stages.support.params import StageError

    def run() -> None:
        if args.rounds < 1:
            raise StageError(f"--rounds must be at least 1, not {args.rounds}")
        print("\n".join(summary(measure(args.rounds))))

    # SIGTERM, Ctrl-C or a dead parent: one line; the pools kill their workers on the way out.
    interrupts.main(run)


if __name__ == "__main__":
    main()
