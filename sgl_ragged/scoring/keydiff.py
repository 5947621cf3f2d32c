"""KeyDiff (Park et al. 2025): keep the keys least similar to the page's anchor key.

The anchor of a KV head is the mean of the page's L2-normalized keys; a token's score is
`-cos(k, anchor)`. Distinctive keys score high, redundant ones low. Needs no queries at all, so
it works identically for prefill chunks, decode and calibration.

Scale: a cosine in [-1, 1] for every head, comparable across the heads of a layer. A zero key
(or a zero anchor) scores 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_ragged.scoring.base import PageStats, Scorer


class KeyDiffScorer(Scorer):
    """Negative cosine similarity of each key to the mean normalized key of its page and head."""

    name = "keydiff"

    def page_scores(self, stats: PageStats) -> torch.Tensor:
        # 1. Unit keys [N, P, H, D] and their per-head mean direction [N, 1, H, D].
        unit = F.normalize(stats.keys.float(), dim=-1)
        anchor = F.normalize(unit.mean(dim=1, keepdim=True), dim=-1)
        # 2. Least similar to the anchor = most distinctive = keep.
        return -(unit * anchor).sum(-1).transpose(1, 2)
