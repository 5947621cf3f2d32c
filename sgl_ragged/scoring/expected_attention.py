"""Expected Attention (kvpress's ExpectedAttentionPress, Devoto et al. 2025), from query statistics.

The queries a KV head will issue next are modelled as a Gaussian q ~ N(mu, diag(var)) whose mean
and variance come from the window queries the page saw (PageStats.q_sum / q_sq_sum / q_count,
pooled over the query heads of the KV head). For a Gaussian,
log E[exp(scale * q.k)] = scale * mu.k + 0.5 * scale^2 * k^T Sigma k, so the expected logit of key
k is `scale * mu.k + 0.5 * scale^2 * sum(var * k^2)`. A softmax over the page's tokens turns the
logits into expected attention shares, which are rescaled by the value norm as kvpress does:
score = (share + epsilon) * ||v||.

Simplifications against kvpress, stated so that nobody mistakes this for the original:
- diagonal covariance only (kvpress keeps the full D x D matrix per head);
- the statistics are those of the post-RoPE queries that observed the page (the prefill chunk's
  observation window, then decode queries); kvpress projects hidden states and averages the RoPE
  rotation over the next 512 positions, which needs the model and is not done here;
- one Gaussian per KV head (the query heads of a GQA group are pooled), not one per query head;
- the softmax is over the P tokens of one page (the compression unit), not the whole context.

Scale: each head's shares sum to 1 over the page, so scores are comparable across the heads of
a layer up to their value norms (the intended weighting). A page no query observed
(q_count == 0) gets uniform logits: score = (1/P + epsilon) * ||v||.
"""

from __future__ import annotations

import torch

from sgl_ragged.scoring.base import PageStats, Scorer


class ExpectedAttentionScorer(Scorer):
    """Expected attention share of each token under the page's query Gaussian, times ||v||."""

    name = "expected_attention"
    rotation_invariant = False  # the diagonal variance is per channel: a rotation changes it

    def __init__(self, epsilon: float = 1e-3) -> None:
        if epsilon < 0:
            raise ValueError(f"expected_attention epsilon must be >= 0, got {epsilon}")
        self.epsilon = epsilon

    def page_scores(self, stats: PageStats) -> torch.Tensor:
        mean, var = query_gaussian(stats)  # [N, H, D] each
        keys = stats.keys.float()  # [N, P, H, D]
        # 1. Expected logit: log E[exp(scale q.k)] under q ~ N(mean, diag(var)).
        linear = torch.einsum("nphd,nhd->nhp", keys, mean)  # [N, H, P] mu.k
        quadratic = torch.einsum("nphd,nhd->nhp", keys.square(), var)  # [N, H, P] k^T Sigma k
        logits = stats.scale * linear + 0.5 * stats.scale**2 * quadratic
        # 2. Expected attention shares within the page, per head.
        shares = torch.softmax(logits, dim=-1)
        # 3. Weighted by how much each value can move the output.
        return (shares + self.epsilon) * stats.values.float().norm(dim=-1).transpose(1, 2)


def query_gaussian(stats: PageStats) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and diagonal variance [N, H, D] float32 of the observing queries; zero for pages
    no query observed (q_count == 0), which makes every logit 0."""
    seen = (stats.q_count > 0)[:, None, None]  # [N, 1, 1]
    count = stats.q_count.clamp(min=1.0)[:, None, None]
    mean = torch.where(seen, stats.q_sum / count, 0.0)
    var = torch.where(seen, (stats.q_sq_sum / count - mean.square()).clamp(min=0.0), 0.0)
    return mean, var
