"""Arithmetic of the accuracy benchmark (bench/accuracy.py): KL divergence from top-K logprobs
with one bucket for the remaining mass, binomial standard errors, and paired comparisons (the
mean ± SE itself: sgl_ragged/stats.py). Pure functions,
so unit tests check them against brute force."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from sgl_ragged.stats import MeanSE, mean_se


def kl_topk(ref_logprobs: Sequence[float], cfg_logprobs: Sequence[float]) -> float:
    """KL(P || Q) over the reference's top-K tokens plus one bucket for everything else.

    `ref_logprobs[i]` and `cfg_logprobs[i]` are log P and log Q of the same token i (the K tokens
    most likely under P). The rest of the vocabulary is merged into one outcome with mass
    1 - sum(P_i) under P and 1 - sum(Q_i) under Q. Merging outcomes never increases a KL
    divergence (data processing inequality), so this is a lower bound of the full-vocabulary KL,
    exact when the K tokens cover the vocabulary.
    """
    if len(ref_logprobs) != len(cfg_logprobs) or not ref_logprobs:
        raise ValueError(f"need two equally long non-empty lists, got {len(ref_logprobs)} and "
                         f"{len(cfg_logprobs)}")
    head = sum(math.exp(p) * (p - q) for p, q in zip(ref_logprobs, cfg_logprobs, strict=True))
    p_rest = max(0.0, 1.0 - sum(math.exp(p) for p in ref_logprobs))
    q_rest = max(1e-30, 1.0 - sum(math.exp(q) for q in cfg_logprobs))
    return head + (p_rest * math.log(p_rest / q_rest) if p_rest > 1e-12 else 0.0)


def binomial_se(successes: int, n: int) -> MeanSE:
    """Proportion p = successes / n and its binomial standard error sqrt(p (1 - p) / n)."""
    if n == 0:
        return MeanSE(math.nan, math.nan, 0)
    p = successes / n
    return MeanSE(p, math.sqrt(p * (1 - p) / n), n)


class Diff(NamedTuple):
    """Mean of paired differences a_i - b_i over the same samples, and its standard error."""

    mean: float
    se: float
    n: int

    @property
    def z(self) -> float:
        """Difference in units of its standard error (inf when SE is 0 and the mean is not)."""
        if self.se > 0:
            return self.mean / self.se
        return 0.0 if self.mean == 0 else math.copysign(math.inf, self.mean)

    @property
    def exceeds_se(self) -> bool:
        """|mean difference| > its standard error (a one-sigma flag, not a significance test)."""
        return abs(self.z) > 1.0

    @property
    def exceeds_2se(self) -> bool:
        """|mean difference| > 2 standard errors (roughly p < 0.05, two-sided)."""
        return abs(self.z) > 2.0


def paired_diff(a: Sequence[float], b: Sequence[float]) -> Diff:
    """Paired difference of two configurations on the same samples (SE of the differences, which
    removes the per-sample difficulty both share)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    m = mean_se([x - y for x, y in zip(a, b, strict=True)])
    return Diff(m.mean, m.se, m.n)
