"""The reproduce stage's task as a worker runs it: gat.seeds.train_seeds, and where it ran (the host, the torch and
CPU facts on which bit-identity depends, and a digest of the training code, which every worker must share).

This module imports only torch and the library: a Dask worker imports it to run the task.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

import gat
from gat.config import Setup
from gat.seeds import BatchResult, train_seeds

# The files of the library whose content decides a result: Python and the native kernels' sources.
SOURCE_SUFFIXES = frozenset({".py", ".cpp", ".c", ".h", ".cu", ".cuh"})


def _cpu_model() -> str:
    from gat.fused import cpu_facts

    facts = cpu_facts()
    return facts[0] if facts is not None and facts[0] != "?" else platform.processor() or "unknown"


@functools.lru_cache(maxsize=1)
def code_sha256() -> str:
    """SHA-256 over the library's sources (native ones included) and this module, as this process sees them: two
    processes with equal digests run the same training code (a Dask worker started from another checkout would
    not)."""
    package = Path(gat.__file__).parent
    sources = sorted(path for path in package.rglob("*") if path.suffix in SOURCE_SUFFIXES and path.is_file())
    digest = hashlib.sha256()
    for path in [*sources, Path(__file__)]:
        name = path.relative_to(package).as_posix() if path.is_relative_to(package) else path.name
        digest.update(f"{name}\0".encode() + path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _process_facts() -> dict[str, str]:
    return {"worker_host": socket.gethostname(), "worker_pid": str(os.getpid()),
            "torch_version": torch.__version__,
            # The vector instructions torch's CPU kernels dispatch to (AVX2, AVX512, ...): a different one can
            # round differently, the first thing to compare when two machines disagree.
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_mkl": str(torch.backends.mkl.is_available()),
            "cpu_model": _cpu_model(), "machine": platform.machine(),
            "python_version": platform.python_version(), "platform": sys.platform,
            "code_sha256": code_sha256()}


def worker_facts() -> dict[str, str]:
    """Where a batch ran: the host and the torch/CPU facts on which bit-identity across machines depends."""
    facts = {**_process_facts(), "torch_threads": str(torch.get_num_threads())}
    distributed = sys.modules.get("distributed")  # imported in a Dask worker, not in a local one
    if distributed is not None:
        try:
            facts["worker_address"] = distributed.get_worker().address
        except ValueError:  # not in a Dask task
            pass
    return facts



def train_seed_batch(graph_tensors: Mapping[str, Tensor], setup: Setup, seeds: Sequence[int], device: torch.device,
                     should_stop: Callable[[], bool] | None = None) -> BatchResult:
    """gat.seeds.train_seeds, with where it ran added to `result.worker`."""
    code_sha256()  # the code as it is when this process starts its first batch (a file edited later is not run)
    result = train_seeds(graph_tensors, setup, seeds, device, should_stop)
    return dataclasses.replace(result, worker={**worker_facts(), **result.worker})
