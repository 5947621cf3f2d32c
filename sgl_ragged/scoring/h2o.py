"""H2O, the Heavy-Hitter Oracle (Zhang et al. 2023): accumulated attention mass.

A token's score is the attention it received, summed over every query that observed it while
its page sat in the recent window (PageStats.attn_sum: probabilities max-reduced over the query
heads of each KV head), not divided by the number of observers: early tokens of a page that more
queries saw have had more chances to become heavy hitters, as in H2O.

Scale: sums of softmax probabilities in [0, obs_count]; every head of a layer is observed by the
same queries, so the scores are comparable across heads.

TOVA (Oren et al. 2024) would keep by the attention of the most recent query only; PageStats
carries accumulated sums, not the last query's attention, so it is not offered (the design asks
for "tova or h2o").
"""

from __future__ import annotations

import torch

from sgl_ragged.scoring.base import PageStats, Scorer


class H2OScorer(Scorer):
    """Summed observed attention of each token (no normalization by observation count)."""

    name = "h2o"

    def page_scores(self, stats: PageStats) -> torch.Tensor:
        return stats.attn_sum.float().clone()
