"""SnapKV scoring (Li et al. 2024), as TANGRAM's per-chunk scorer uses it.

Observation window = the last `window` queries of a prefill chunk (plus, here, every decode
query while the page stays in the recent window); attention probabilities are reduced over the
query heads of each KV head with max, averaged over the observing queries, and max-pooled along
the token axis (kernel 7) so that neighbours of an important token survive with it.

Scale: mean attention probabilities in [0, 1]; every head of a layer is observed by the same
queries, so the scores are comparable across heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_ragged.scoring.base import PageStats, Scorer


def gqa_reduce(probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """probs [Q, H_q, N] -> [Q, H_kv, N]: max over the query heads sharing a KV head."""
    q, h_q, n = probs.shape
    return probs.view(q, num_kv_heads, h_q // num_kv_heads, n).amax(dim=2)


def window_attention_probs(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal softmax attention of window queries over keys.

    q: [Q, H_q, D] window queries; k: [N, H_kv, D] keys (post-RoPE);
    q_pos: [Q] int64 and k_pos: [N] int64 sequence positions. Returns probs [Q, H_q, N] float32.
    """
    h_q, h_kv = q.shape[1], k.shape[1]
    k_rep = k.float().repeat_interleave(h_q // h_kv, dim=1)  # [N, H_q, D]
    logits = torch.einsum("qhd,nhd->qhn", q.float(), k_rep) * scale
    future = k_pos[None, :] > q_pos[:, None]  # [Q, N]
    logits.masked_fill_(future[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)


class SnapKVScorer(Scorer):
    """Mean observed attention per token, max-pooled along the page (kernel `pool_kernel`)."""

    name = "snapkv"

    def __init__(self, pool_kernel: int = 7) -> None:
        if pool_kernel < 1 or pool_kernel % 2 == 0:
            raise ValueError(f"snapkv pool kernel must be odd and >= 1, got {pool_kernel}")
        self.pool_kernel = pool_kernel

    def page_scores(self, stats: PageStats) -> torch.Tensor:
        mean = stats.attn_sum / stats.obs_count.clamp(min=1.0).unsqueeze(-2)
        if self.pool_kernel == 1:
            return mean
        flat = mean.reshape(-1, 1, mean.shape[-1])
        pooled = F.max_pool1d(flat, self.pool_kernel, stride=1, padding=self.pool_kernel // 2)
        return pooled.view_as(mean)
