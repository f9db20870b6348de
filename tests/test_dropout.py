"""gat.dropout: keep rate, scale, and one independent stream per replica."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gat.dropout import ReplicaDropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.6, 0.9])
def test_keep_rate_and_scale(p: float) -> None:
    mask = ReplicaDropout([0, 1, 2], p).keep(200_000)
    assert mask.shape == (3, 200_000) and mask.dtype == torch.float32
    kept = mask != 0
    for rate in kept.double().mean(1).tolist():
        assert abs(rate - (1 - p)) < 0.005, rate  # ~7 standard deviations at worst
    assert torch.all(mask[kept] == np.float32(1 / (1 - p)))
    # Inverted dropout: the mask has mean 1, so the expected activation is unchanged.
    assert abs(mask.double().mean().item() - 1) < 0.02


def test_the_threshold_is_exact_below_the_top_byte() -> None:
    """p = (128 + 1/2)/256: every draw whose top byte is 128 is decided by its other 24 bits.

    Keeping all of them would give 0.5, dropping all 0.49609; the exact rate is 0.49805.
    """
    p = (128 + 0.5) / 256
    kept = (ReplicaDropout([3], p).keep(8_000_000) != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.0009, kept  # 5 standard deviations, half the distance to a wrong rule


def test_p_zero_keeps_everything() -> None:
    assert torch.equal(ReplicaDropout([4], 0.0).keep(1000), torch.ones(1, 1000))


def test_shape_follows_the_arguments() -> None:
    noise = ReplicaDropout([1, 2], 0.5)
    assert noise.keep(3, 4, 5).shape == (2, 3, 4, 5)
    assert noise.keep(7).shape == (2, 7)


def test_same_seed_gives_the_same_masks_and_another_seed_does_not() -> None:
    a, b, c = ReplicaDropout([5], 0.6), ReplicaDropout([5], 0.6), ReplicaDropout([6], 0.6)
    for shape in [(10, 3), (7,), (1000,)]:
        mask_a, mask_b, mask_c = a.keep(*shape), b.keep(*shape), c.keep(*shape)
        assert torch.equal(mask_a, mask_b)
        if mask_a.numel() >= 1000:
            assert not torch.equal(mask_a, mask_c)
    # Successive draws continue the stream; they do not repeat it.
    assert not torch.equal(a.keep(1000), ReplicaDropout([5], 0.6).keep(1000))


def test_a_replica_draws_the_same_masks_alone_or_beside_others() -> None:
    alone, batch = ReplicaDropout([5], 0.6), ReplicaDropout([1, 5, 9], 0.6)
    for shape in [(3, 7), (1,), (5, 1, 3), (1001,), (2, 2)]:  # odd counts too: half a 64-bit draw is left over
        mask_alone, mask_batch = alone.keep(*shape), batch.keep(*shape)
        assert mask_batch.shape == (3, *shape)
        assert torch.equal(mask_batch[1], mask_alone[0])
    assert not torch.equal(batch.keep(1000)[0], batch.keep(1000)[2])


def test_select_keeps_the_listed_streams() -> None:
    batch = ReplicaDropout([1, 5, 9], 0.5)
    singles = {seed: ReplicaDropout([seed], 0.5) for seed in (1, 5, 9)}
    batch.keep(10, 3)
    for single in singles.values():
        single.keep(10, 3)
    batch.select(torch.tensor([2, 0]))
    mask = batch.keep(257)
    assert mask.shape == (2, 257)
    assert torch.equal(mask[0], singles[9].keep(257)[0])
    assert torch.equal(mask[1], singles[1].keep(257)[0])
    # Selecting again indexes the current list, as the training loop does when a second replica stops.
    batch.select(torch.tensor([1]))
    assert torch.equal(batch.keep(64)[0], singles[1].keep(64)[0])
