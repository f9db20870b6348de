"""Batches of seeds on the reproduce executors, as the reproduce stage and the ablation run them: the pool of
`reproduce.executor` (local worker processes or a Dask cluster), the batches gathered as they finish, and the
checks that every worker trained with this process's kernel and code."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from gat.config import Setup
from gat.seeds import BatchResult
from gat.training import planned_kernel
from stages.support.local_pool import WorkerPool, worker_pool
from stages.support.params import fail
from stages.support.progress import Progress
from stages.support.seed_task import code_sha256
from stages.support.seed_task import train_seed_batch as train_seeds

if TYPE_CHECKING:
    from stages.support.dask_pool import DaskPool


@contextlib.contextmanager
def starting_pool(executor: str, workers: int, device: torch.device, start_now: bool = True
                  ) -> Iterator[Callable[[], "WorkerPool | DaskPool"]]:
    """A function that returns the executor's pool of workers; `workers` 0 is one per core, and one GPU serves one
    process. The workers start as the block begins, so that their start (a process each, importing torch) overlaps
    the stage's own set-up: a Dask LocalCluster in a thread (stages.support.dask_pool.StartingPool); local workers
    with `start_now` (WorkerPool.start), else with their first batch. An exception in the block kills them."""
    if device.type == "cuda":
        workers = 1
    if executor == "dask":
        from stages.support.dask_pool import starting_dask_pool  # Dask is imported only when it is asked for

        with starting_dask_pool(workers) as starting:
            yield starting.pool
        return
    size, preload = workers or os.cpu_count() or 1, (train_seeds.__module__,)  # preload: the training code
    if not start_now:
        yield lambda: worker_pool(size, preload)
        return
    pool = worker_pool(size, preload)
    try:
        pool.start()
        yield lambda: pool  # the block's `with pool_when_ready() as pool` closes it, or kills it on an exception
    except BaseException:
        pool.terminate()  # an exception before that block (the MLflow run failed to open, a stop)
        raise


def gather(pool: "WorkerPool | DaskPool", graph_tensors: dict, jobs: Sequence[tuple[Setup, list[int]]],
           device: torch.device, progress: Progress,
           on_result: Callable[[int, BatchResult], None] | None = None) -> list[BatchResult]:
    """Every job's (setup, batch of seeds) result, in the order of the jobs, whatever order they finished in;
    `on_result(index, result)` as each comes in (each once)."""
    results: dict[int, BatchResult] = {}
    # What this process would train each setup with (gat.training.planned_kernel): every worker must have too.
    num_classes = int(graph_tensors["num_classes"])
    here = [planned_kernel(setup.model, setup.optim, num_classes, device) for setup, _ in jobs]
    for index, result in pool.as_completed(train_seeds, graph_tensors,
                                           [(setup, batch, device) for setup, batch in jobs]):
        check_kernel(result, here[index])  # at the first batch of another kernel: the tasks left are cancelled
        if index not in results:  # each batch once, even if a pool ever handed one back twice
            results[index] = result
            progress.update(len(result.rows))
            if on_result is not None:
                on_result(index, result)
    return [results[index] for index in range(len(jobs))]


def where(result: BatchResult) -> str:
    """The worker that ran a batch, as a user can find it: its Dask address, else its host and process id."""
    facts = result.worker
    return f"{facts.get('worker_address') or facts['worker_host']} (pid {facts['worker_pid']})"


def check_kernel(result: BatchResult, here: str) -> None:
    """Fail when a worker trained with another kernel than this stage process would: one that cannot build, load or
    self-check the fused kernel falls back to the torch one, which rounds differently, so its seeds would give other
    weights than the same seeds here, and the results would be of no one kernel. A fallback that every process
    shares (this machine has no compiler) is no mix: training says so once, and the parent run's tag shows it."""
    used = result.worker["training_kernel"]
    if used != here:
        fail(f"the worker {where(result)} trained with {used}, but this stage trains with {here}: a mix of kernels "
             "gives results of no one kernel; make that worker's kernel match (see its reason), or set `kernel: torch` "
             "in the dataset's `reproduce.protocol` block.")


def check_same_code(results: Sequence[BatchResult] | dict[str, str]) -> None:
    """Fail when a worker ran other training code than this process has (a Dask worker of another checkout)."""
    here = code_sha256()
    found = (results.items() if isinstance(results, dict) else
             ((where(r), r.worker["code_sha256"]) for r in results))
    stale = sorted({worker for worker, digest in found if digest != here})
    if stale:
        fail(f"the worker(s) {', '.join(stale)} ran other code than this stage started with (gat/ or "
             "gat/seeds.py differ, or were edited during the run): rerun it; Dask workers must run this "
             "checkout, with the same pinned requirements (see the README's multi-host section).")
