"""stages.support.seed_pool's checks on what a worker reports with each batch: the same training code and the same
kernel as the stage process, else a one-line StageError naming the worker. (A Dask worker of another checkout, and
one whose fused kernel is off, are run for real in tests/test_dask_executor.py.)"""

from __future__ import annotations

import gat
import pytest

from gat.seeds import BatchResult
from stages.support.params import StageError
from stages.support.seed_pool import check_kernel, check_same_code, where
from stages.support.seed_task import code_sha256


def _result(pid: int, code: str, kernel: str = "fused", address: str | None = None) -> BatchResult:
    worker = {"worker_host": "host-a", "worker_pid": str(pid), "code_sha256": code, "training_kernel": kernel}
    if address is not None:
        worker["worker_address"] = address
    return BatchResult(rows=[], timings={}, worker=worker)


def test_where_names_a_dask_worker_by_address_and_a_local_one_by_host() -> None:
    assert where(_result(7, "x", address="tcp://127.0.0.1:4000")) == "tcp://127.0.0.1:4000 (pid 7)"
    assert where(_result(7, "x")) == "host-a (pid 7)"


def test_batches_of_this_processs_code_pass() -> None:
    check_same_code([_result(1, code_sha256()), _result(2, code_sha256())])
    check_same_code({"tcp://127.0.0.1:4000": code_sha256()})


def test_a_batch_of_other_code_names_only_its_worker() -> None:
    with pytest.raises(StageError) as raised:
        check_same_code([_result(1, code_sha256()), _result(2, "0" * 64), _result(3, "f" * 64)])
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the worker(s) host-a (pid 2), host-a (pid 3) ran other code than this stage started")
    assert "pid 1" not in message and "rerun it" in message


def test_the_digests_workers_report_before_a_batch_are_checked_by_address() -> None:
    with pytest.raises(StageError, match=r"^the worker\(s\) tcp://127\.0\.0\.1:4001 ran other code"):
        check_same_code({"tcp://127.0.0.1:4000": code_sha256(), "tcp://127.0.0.1:4001": "0" * 64})


def test_the_code_digest_is_that_of_the_files_this_process_started_with(tmp_path, monkeypatch) -> None:
    """Cached: a file edited after the first call does not change what this process compares against."""
    first = code_sha256()
    monkeypatch.setattr(gat, "__file__", str(tmp_path / "gat" / "__init__.py"))  # another library folder
    assert code_sha256() == first


def test_a_batch_of_another_kernel_names_both_kernels() -> None:
    check_kernel(_result(1, "x", kernel="fused"), "fused")
    with pytest.raises(StageError) as raised:
        check_kernel(_result(2, "x", kernel="torch (fused unavailable: no compiler)"), "fused")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the worker host-a (pid 2) trained with torch (fused unavailable: no compiler), but "
                              "this stage trains with fused")
