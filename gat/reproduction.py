"""The statistics that compare a many-seed reproduction with the paper's table (gat.datasets holds its figures)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Summary:
    """Mean, sample std (ddof = 1), range and a two-sided t confidence interval of the mean."""

    n: int
    mean: float
    std: float
    min: float
    max: float
    ci_low: float
    ci_high: float


def summarise(values: Sequence[float], confidence: float = 0.95) -> Summary:
    """Summarise independent per-seed values; the CI uses Student's t with n - 1 degrees of freedom."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"need at least 2 values to estimate a spread, got {x.size}")
    mean, std = float(x.mean()), float(x.std(ddof=1))
    half_width = float(stats.t.ppf(0.5 + confidence / 2, df=x.size - 1)) * std / math.sqrt(x.size)
    figures = (mean, std, float(x.min()), float(x.max()), mean - half_width, mean + half_width)
    return Summary(int(x.size), *(_without_float_noise(value) for value in figures))


@dataclass(frozen=True)
class PairedDifference:
    """A variant's per-seed values minus the baseline's on the same seeds: their mean, sample std and paired t
    interval (Student's t with n - 1 degrees of freedom on the n differences), and the sign count: on how many
    seeds the variant was better, worse, or tied."""

    n: int
    mean: float
    std: float
    ci_low: float
    ci_high: float
    better: int
    worse: int
    tied: int


def paired_difference(values: Mapping[int, float], baseline: Mapping[int, float],
                      confidence: float = 0.95) -> PairedDifference:
    """`values` minus `baseline`, paired by seed (both map seed -> value, over the same seeds).

    Pairing removes what a seed shares across variants (its split of luck in initialisation and dropout), so
    the interval is that of the mean difference itself, narrower than the two means' intervals suggest when the
    seeds' results correlate.
    """
    if set(values) != set(baseline):
        raise ValueError(f"pairing needs the same seeds: {sorted(set(values) ^ set(baseline))} are in one only")
    seeds = sorted(values)
    differences = np.asarray([values[s] for s in seeds], np.float64) - np.asarray([baseline[s] for s in seeds])
    spread = summarise(differences.tolist(), confidence)
    better, worse = int((differences > 0).sum()), int((differences < 0).sum())
    return PairedDifference(spread.n, spread.mean, spread.std, spread.ci_low, spread.ci_high, better, worse,
                            spread.n - better - worse)


def _without_float_noise(value: float) -> float:
    """12 significant digits: a mean of accuracies is 0.83255, not the 0.8325499999999998 that summing leaves.

    Every figure here comes from values with at most a few digits (accuracies of 1,000 test nodes, epochs), so
    12 digits keep all the information and drop only the rounding of float arithmetic.
    """
    return float(f"{value:.12g}")


# The width of a histogram bin of accuracy: half a percentage point, exactly.
BIN_WIDTH = Fraction(1, 200)


def correct_answers(accuracies: Sequence[float], nodes: int) -> list[int]:
    """The number of correct answers out of `nodes` that each accuracy stands for, exactly.

    An accuracy is `correct / nodes` in float64 (gat.training.loss_and_accuracy), so `round(accuracy * nodes)`
    gives back `correct`; a value that is no such fraction is a ValueError, not a guess.
    """
    if nodes < 1:
        raise ValueError(f"need at least one test node, got {nodes}")
    counts = []
    for accuracy in accuracies:
        correct = round(accuracy * nodes)
        if not 0 <= correct <= nodes or correct / nodes != accuracy:
            raise ValueError(f"{accuracy!r} is not a number of correct answers out of {nodes} nodes")
        counts.append(correct)
    return counts


def histogram(correct: Sequence[int], nodes: int,
              bin_width: Fraction = BIN_WIDTH) -> list[tuple[Fraction, Fraction, int]]:
    """Counts of the accuracies `correct[i] / nodes` in bins of `bin_width`: [(low, high, count)], exact.

    Bins are aligned to multiples of the width, from the lowest accuracy's bin to the highest's, and are
    left-closed, [low, high): an accuracy on an edge counts in the bin above it. The last possible bin,
    [1 - width, 1], is closed on both sides, so that 1.0 counts in it. The arithmetic is on integers and
    fractions, never on float edges, so the counts sum to `len(correct)` and an accuracy on an edge is never
    put in the bin below by a rounding error.
    """
    width = Fraction(bin_width)
    if width <= 0 or (1 / width).denominator != 1:
        raise ValueError(f"the bin width must divide 1 exactly (1/200, 1/100, ...), got {width}")
    if not correct:
        raise ValueError("no accuracies to count")
    if any(not 0 <= c <= nodes for c in correct):
        raise ValueError(f"correct answers must lie in [0, {nodes}], got {min(correct)} to {max(correct)}")
    last = int(1 / width) - 1  # the bin [1 - width, 1]
    index = Counter(min(Fraction(c, nodes) // width, last) for c in correct)
    return [(k * width, (k + 1) * width, index[k]) for k in range(min(index), max(index) + 1)]
