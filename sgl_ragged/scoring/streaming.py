"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens, by position only.

Budgets here are page-local (each page keeps its own top-k), so "the most recent tokens" becomes
"the latest tokens of each page": a token's score is its offset within the page, later is
higher. The sinks (the sequence's first SINK_TOKENS tokens) are forced in by the selector, as
for every scorer; the recent window of whole pages is kept by staging. This is the closest
equivalent of StreamingLLM that a per-page compression unit can express.

Scale: (offset + 1) / P in (0, 1], identical for every head. Under TANGRAM's Eq. 3 all heads tie,
so calibrating with this scorer says nothing about heads; use it with uniform budgets.
"""

from __future__ import annotations

import torch

from sgl_ragged.scoring.base import PageStats, Scorer


class StreamingScorer(Scorer):
    """Position within the page: the later a token, the more it is kept."""

    name = "streaming"

    def page_scores(self, stats: PageStats) -> torch.Tensor:
        n, h, p = stats.attn_sum.shape
        offsets = torch.arange(1, p + 1, dtype=torch.float32, device=stats.attn_sum.device) / p
        return offsets.expand(n, h, p).clone()
