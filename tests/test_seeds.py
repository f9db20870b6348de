"""gat.seeds.batches: the reproduce stage's batches of seeds, their last round split over the workers."""

from __future__ import annotations

import pytest

from gat.seeds import batches


def test_the_last_round_is_split_so_that_two_workers_train_50_seeds_each() -> None:
    planned = batches(range(100), 4, 2)
    assert planned[:24] == [list(range(start, start + 4)) for start in range(0, 96, 4)]
    assert planned[24:] == [[96, 97], [98, 99]]


@pytest.mark.parametrize("seeds, size, workers", [(100, 4, 1), (100, 4, 2), (100, 4, 3), (10, 4, 2), (3, 4, 8),
                                                  (7, 1, 2), (0, 4, 2), (101, 50, 2), (16, 4, 4)])
def test_every_seed_once_in_order_no_batch_over_size_and_the_workers_evenly_loaded(seeds: int, size: int,
                                                                                  workers: int) -> None:
    planned = batches(list(range(seeds)), size, workers)
    assert [seed for batch in planned for seed in batch] == list(range(seeds))
    assert all(1 <= len(batch) <= size for batch in planned)
    # After the full rounds: at most one batch per worker, and those differ by one seed at most.
    full = seeds // (size * workers) * size * workers
    tail = [len(batch) for batch in planned[full // size:]]
    assert len(tail) <= workers and (not tail or max(tail) - min(tail) <= 1)


def test_one_worker_keeps_plain_batches() -> None:
    assert batches([5, 6, 7, 8, 9], 2) == [[5, 6], [7, 8], [9]]
