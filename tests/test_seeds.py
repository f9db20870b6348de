"""gat.seeds.batches: the reproduce stage's batches of seeds, their last round in ever smaller batches."""

from __future__ import annotations

import pytest

from gat.seeds import batches


def test_after_the_full_rounds_two_workers_take_the_last_seeds_one_by_one() -> None:
    planned = batches(range(100), 4, 2)
    assert planned[:24] == [list(range(start, start + 4)) for start in range(0, 96, 4)]
    assert planned[24:] == [[96], [97], [98], [99]]


def test_a_long_last_round_shrinks_to_single_seeds() -> None:
    # 50 seeds after two batches of 50: each batch a quarter of the seeds left, rounded up.
    assert [len(batch) for batch in batches(range(150), 50, 2)] == [50, 50, 13, 10, 7, 5, 4, 3, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("seeds, size, workers", [(100, 4, 1), (100, 4, 2), (100, 4, 3), (10, 4, 2), (3, 4, 8),
                                                  (7, 1, 2), (0, 4, 2), (101, 50, 2), (16, 4, 4), (150, 50, 2)])
def test_every_seed_once_in_order_no_batch_over_size_and_the_last_batches_shrinking(seeds: int, size: int,
                                                                                     workers: int) -> None:
    planned = batches(list(range(seeds)), size, workers)
    assert [seed for batch in planned for seed in batch] == list(range(seeds))
    assert all(1 <= len(batch) <= size for batch in planned)
    if workers > 1:
        # After the full rounds: batches that never grow, and the last one a single seed.
        full = seeds // (size * workers) * size * workers
        tail = [len(batch) for batch in planned[full // size:]]
        assert tail == sorted(tail, reverse=True) and (not tail or tail[-1] == 1)


def test_one_worker_keeps_plain_batches() -> None:
    assert batches([5, 6, 7, 8, 9], 2) == [[5, 6], [7, 8], [9]]
