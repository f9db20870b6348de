"""The paper's table, and the statistics that compare a many-seed reproduction with it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class PaperResult:
    """Test accuracy as Table 3 of the paper reports it: mean ± std over 100 runs (fractions)."""

    mean: float
    std: float

    def contains(self, value: float) -> bool:
        """Whether `value` lies inside the paper's mean ± std band."""
        return self.mean - self.std <= value <= self.mean + self.std


PAPER = {
    "cora": PaperResult(0.830, 0.007),
    "citeseer": PaperResult(0.725, 0.007),
    "pubmed": PaperResult(0.790, 0.003),
}


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


def _without_float_noise(value: float) -> float:
    """12 significant digits: a mean of accuracies is 0.83255, not the 0.8325499999999998 that summing leaves.

    Every figure here comes from values with at most a few digits (accuracies of 1,000 test nodes, epochs), so
    12 digits keep all the information and drop only the rounding of float arithmetic.
    """
    return float(f"{value:.12g}")


def histogram(values: Sequence[float], bin_width: float = 0.005) -> list[tuple[float, float, int]]:
    """Counts of `values` in bins of `bin_width` aligned to multiples of it: [(low, high, count)]."""
    x = np.asarray(values, dtype=np.float64)
    # Rounding before floor/ceil keeps values that sit on an edge (0.83 = 166 * 0.005) in one bin.
    low = math.floor(round(x.min() / bin_width, 9)) * bin_width
    high = max(math.ceil(round(x.max() / bin_width, 9)), round(low / bin_width) + 1) * bin_width
    edges = np.linspace(low, high, int(round((high - low) / bin_width)) + 1)
    counts, _ = np.histogram(x, bins=edges)
    return [(float(a), float(b), int(c)) for a, b, c in zip(edges[:-1], edges[1:], counts)]
