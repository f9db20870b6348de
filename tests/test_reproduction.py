"""gat/reproduction.py: the statistics of a many-seed reproduction, on numbers worked out by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from gat.datasets import DATASETS
from gat.reproduction import correct_answers, histogram, paired_difference, summarise


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


def test_paired_difference_is_the_t_interval_of_the_per_seed_differences() -> None:
    """Seeds 0-3: the variant minus gat is +0.01, -0.00, +0.02, +0.03 (seed 1 tied); worked out by hand."""
    gat = {0: 0.80, 1: 0.83, 2: 0.81, 3: 0.82}
    variant = {3: 0.85, 0: 0.81, 2: 0.83, 1: 0.83}  # any order: paired by the seed, not the position
    d = paired_difference(variant, gat)
    assert (d.n, d.better, d.worse, d.tied) == (4, 3, 0, 1)
    assert d.mean == pytest.approx(0.015)
    std = math.sqrt((0.005**2 + 0.015**2 + 0.005**2 + 0.015**2) / 3)
    assert d.std == pytest.approx(std)
    half_width = 3.182446 * std / 2  # Student's t, 3 degrees of freedom, 97.5th percentile; sqrt(4) seeds
    assert (d.ci_low, d.ci_high) == (pytest.approx(0.015 - half_width, abs=1e-6),
                                     pytest.approx(0.015 + half_width, abs=1e-6))


def test_paired_difference_agrees_with_scipys_paired_t_test() -> None:
    from scipy import stats

    rng = np.random.default_rng(0)
    gat = {seed: 0.83 + 0.007 * rng.standard_normal() for seed in range(100)}
    # Correlated with gat seed by seed, as two variants on the same seed are: pairing narrows the interval.
    variant = {seed: value - 0.002 + 0.002 * rng.standard_normal() for seed, value in gat.items()}
    d = paired_difference(variant, gat)
    interval = stats.ttest_rel(list(variant.values()), list(gat.values())).confidence_interval(0.95)
    assert (d.ci_low, d.ci_high) == (pytest.approx(interval.low, abs=1e-9), pytest.approx(interval.high, abs=1e-9))
    unpaired = summarise(list(variant.values()))
    assert d.ci_high - d.ci_low < (unpaired.ci_high - unpaired.ci_low) / 2
    assert d.better + d.worse + d.tied == 100 and d.worse > d.better


def test_paired_difference_needs_the_same_seeds() -> None:
    with pytest.raises(ValueError, match=r"pairing needs the same seeds: \[2\] are in one only"):
        paired_difference({0: 0.8, 1: 0.8}, {0: 0.8, 1: 0.8, 2: 0.8})


def test_confidence_interval_narrows_with_more_seeds() -> None:
    few = summarise([0.82, 0.84] * 5)
    many = summarise([0.82, 0.84] * 50)
    assert few.mean == pytest.approx(many.mean)
    assert many.ci_high - many.ci_low < few.ci_high - few.ci_low


def test_one_value_has_no_spread() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        summarise([0.83])


def test_histogram_bins_cover_every_value_once() -> None:
    correct = [812, 830, 831, 834, 844]
    bins = histogram(correct, 1000)
    assert (bins[0][0], bins[-1][1]) == (Fraction(81, 100), Fraction(169, 200))
    assert sum(count for _, _, count in bins) == len(correct)
    counts = {float(low): count for low, _, count in bins}
    assert counts == {0.81: 1, 0.815: 0, 0.82: 0, 0.825: 0, 0.83: 3, 0.835: 0, 0.84: 1}


def test_correct_answers_are_recovered_exactly() -> None:
    assert correct_answers([830 / 1000, 0.0, 1.0, 693 / 1000], 1000) == [830, 0, 1000, 693]
    assert correct_answers([1 / 3], 3) == [1]
    with pytest.raises(ValueError, match="not a number of correct answers"):
        correct_answers([0.8305], 1000)
    with pytest.raises(ValueError, match="not a number of correct answers"):
        correct_answers([1.001], 1000)


def test_histogram_bins_are_left_closed_at_every_edge() -> None:
    """Every accuracy that sits exactly on an edge (0.830 = 830/1000, which float edges from `linspace` put below
    it) counts in the bin above it: the counts are what counting `[low, high)` by hand gives."""
    nodes = 1000
    correct = list(range(805, 850))  # every accuracy from 0.805 to 0.849 once: 5 per bin, one on each low edge
    bins = histogram(correct, nodes)
    assert [(low, high) for low, high, _ in bins] == [(Fraction(k, 200), Fraction(k + 1, 200)) for k in range(161, 170)]
    assert [count for _, _, count in bins] == [5] * 9
    for low, high, count in bins:
        assert count == sum(1 for c in correct if low <= Fraction(c, nodes) < high)
    # The case: 0.830 and 0.835 on the edges of the 0.830-0.835 bin.
    counts = {float(low): count for low, _, count in histogram([825, 829, 830, 834, 835], nodes)}
    assert counts == {0.825: 2, 0.83: 2, 0.835: 1}


def test_histogram_counts_every_seed_once_and_closes_the_last_bin() -> None:
    nodes = 1000
    top = histogram([995, 999, 1000], nodes)
    assert top == [(Fraction(199, 200), Fraction(1), 3)]  # 1.0 counts in [0.995, 1.0], no bin above 1
    assert histogram([0, 4, 5], nodes) == [(Fraction(0), Fraction(1, 200), 2), (Fraction(1, 200), Fraction(1, 100), 1)]
    # A test split whose size is not a multiple of 200 (Citeseer's 1,000 is; a random split's need not be).
    correct = list(range(0, 334))
    bins = histogram(correct, 333)
    assert sum(count for _, _, count in bins) == len(correct)
    for low, high, count in bins:
        closed = high == 1
        assert count == sum(1 for c in correct if low <= Fraction(c, 333) and (Fraction(c, 333) < high or closed))
    with pytest.raises(ValueError, match="divide 1"):
        histogram([1], 10, bin_width=Fraction(3, 200))
    with pytest.raises(ValueError, match="lie in"):
        histogram([11], 10)


def test_histogram_figure_draws_the_csv_bins_as_they_are() -> None:
    """The MLflow picture is drawn from histogram.csv's rows, not binned again: one bar per row, its height
    the row's count, its edges the row's."""
    from stages.support.tables import histogram_bins, histogram_figure

    accuracies = [c / 1000 for c in (825, 829, 830, 830, 834, 835, 841)]
    bins = histogram_bins(histogram(correct_answers(accuracies, 1000), 1000))
    assert bins == [{"test_acc_bin": "0.825-0.830", "seeds": 2}, {"test_acc_bin": "0.830-0.835", "seeds": 3},
                    {"test_acc_bin": "0.835-0.840", "seeds": 1}, {"test_acc_bin": "0.840-0.845", "seeds": 1}]
    summary = {"dataset": "cora", "seeds": len(accuracies), "paper": vars(DATASETS["cora"].paper),
               "test": {"mean": sum(accuracies) / len(accuracies)}}
    figure = histogram_figure(bins, summary)
    (bars,) = figure.axes[0].containers
    assert [patch.get_height() for patch in bars] == [row["seeds"] for row in bins]
    assert [(round(patch.get_x(), 6), round(patch.get_x() + patch.get_width(), 6)) for patch in bars] == [
        (82.5, 83.0), (83.0, 83.5), (83.5, 84.0), (84.0, 84.5)]
