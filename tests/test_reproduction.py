"""gat/reproduction.py: the statistics of a many-seed reproduction, on numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from gat.reproduction import PAPER, PaperResult, histogram, summarise


def test_summary_of_known_numbers() -> None:
    summary = summarise([0.80, 0.82, 0.84])
    assert summary.n == 3
    assert summary.mean == pytest.approx(0.82)
    assert summary.std == pytest.approx(0.02)  # sample std: sqrt((0.02² + 0 + 0.02²) / 2)
    assert (summary.min, summary.max) == (0.80, 0.84)
    # Student's t, 2 degrees of freedom, 97.5th percentile = 4.302653.
    half_width = 4.302653 * 0.02 / math.sqrt(3)
    assert summary.ci_low == pytest.approx(0.82 - half_width, abs=1e-6)
    assert summary.ci_high == pytest.approx(0.82 + half_width, abs=1e-6)


def test_confidence_interval_narrows_with_more_seeds() -> None:
    few = summarise([0.82, 0.84] * 5)
    many = summarise([0.82, 0.84] * 50)
    assert few.mean == pytest.approx(many.mean)
    assert many.ci_high - many.ci_low < few.ci_high - few.ci_low


def test_one_value_has_no_spread() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        summarise([0.83])


def test_paper_band() -> None:
    assert PAPER["cora"] == PaperResult(0.830, 0.007)
    assert PAPER["citeseer"].contains(0.725 + 0.007) and PAPER["citeseer"].contains(0.725 - 0.007)
    assert not PAPER["cora"].contains(0.8229) and not PAPER["cora"].contains(0.8371)


def test_histogram_bins_cover_every_value_once() -> None:
    values = [0.812, 0.830, 0.831, 0.834, 0.8449]
    bins = histogram(values, bin_width=0.005)
    assert bins[0][0] == pytest.approx(0.810) and bins[-1][1] == pytest.approx(0.845)
    assert sum(count for _, _, count in bins) == len(values)
    counts = {round(low, 3): count for low, _, count in bins}
    assert counts == {0.81: 1, 0.815: 0, 0.82: 0, 0.825: 0, 0.83: 3, 0.835: 0, 0.84: 1}
