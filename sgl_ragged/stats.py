"""Mean and standard error over independent samples, shared by the tier search
(calibrate/tier_search.py) and the benchmarks (bench/accuracy_stats.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class MeanSE(NamedTuple):
    mean: float
    se: float  # standard error of the mean
    n: int


def mean_se(values: Sequence[float]) -> MeanSE:
    """Sample mean and its standard error sd / sqrt(n) (sd with n - 1); SE is NaN for n < 2."""
    n = len(values)
    if n == 0:
        return MeanSE(math.nan, math.nan, 0)
    mean = sum(values) / n
    if n < 2:
        return MeanSE(mean, math.nan, n)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return MeanSE(mean, math.sqrt(var / n), n)
