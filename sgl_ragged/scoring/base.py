"""Scorer interface: what a page saw while it sat in the recent window -> per-head token scores."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

SINK_TOKENS = 4
"""The first tokens of every sequence are always kept (StreamingLLM's attention sinks)."""


@dataclass(frozen=True)
class PageStats:
    """Everything a scorer may use about N pages of one layer (all on one device).

    Serving accumulates these while a page sits in the recent window (prefill: the chunk's
    observation window; decode: every decode query); calibration builds them per chunk the
    same way. Query statistics are pooled over the query heads that share a KV head.
    """

    attn_sum: torch.Tensor  # [N, H_kv, P] float32 summed GQA-reduced (max) attention probs
    obs_count: torch.Tensor  # [N, P] float32 how many queries observed each token
    keys: torch.Tensor  # [N, P, H_kv, D] post-RoPE keys (any float dtype)
    values: torch.Tensor  # [N, P, H_kv, D] values
    q_sum: torch.Tensor  # [N, H_kv, D] float32 sum of observing queries (post-RoPE, unscaled)
    q_sq_sum: torch.Tensor  # [N, H_kv, D] float32 sum of their squares
    q_count: torch.Tensor  # [N] float32 query vectors summed (queries x query heads per KV head)
    scale: float  # the attention softmax scale (1/sqrt(D) unless the model says otherwise)

    @property
    def page_size(self) -> int:
        return self.attn_sum.shape[-1]


class Scorer(ABC):
    """Turns the statistics of N pages into per-KV-head importance scores `[N, H_kv, P]`.

    Higher means keep. Scores must be comparable across the heads of a layer: calibration ranks
    all heads' tokens together (TANGRAM Eq. 3). Sink tokens are handled by the selector.
    Adding a method is one subclass with a `name` and `page_scores` (kvpress's shape).
    """

    name: str
    # Scores unchanged when every key, value and query of a head is rotated by one orthogonal
    # matrix (--ragged-rotation hadamard): true of scores read from attention probabilities,
    # dot products and norms.
    rotation_invariant: bool = True

    @abstractmethod
    def page_scores(self, stats: PageStats) -> torch.Tensor:
        """Returns scores [N, H_kv, P] float32."""


def page_query_stats(
    q_win: torch.Tensor, q_pos: torch.Tensor, page_start: torch.Tensor, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PageStats' query fields from one forward's window queries: per page, the queries that saw
    it (position >= the page's first position), pooled over the query heads of each KV head.

    q_win: [w, H_q, D] window queries; q_pos: [w] int64 their positions; page_start: [N] int64
    each page's first position. Returns q_sum, q_sq_sum [N, H_kv, D] float32, q_count [N] float32.
    """
    w, h_q, d = q_win.shape
    grouped = q_win.float().view(w, num_kv_heads, h_q // num_kv_heads, d)  # [w, H_kv, G, D]
    saw = (q_pos[None, :] >= page_start[:, None]).float()  # [N, w]
    sums = torch.einsum("pw,whgd->phd", saw, grouped)
    squares = torch.einsum("pw,whgd->phd", saw, grouped.square())
    return sums, squares, saw.sum(1) * (h_q // num_kv_heads)
