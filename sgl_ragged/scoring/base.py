"""Scorer interface: what a page saw while it sat in the recent window -> per-head token scores."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

SINK_TOKENS = 4
"""The first tokens of every sequence are always kept (StreamingLLM's attention sinks)."""


class Scorer(ABC):
    """Turns attention statistics of a page into per-KV-head importance scores.

    The serving path accumulates, per window page and KV head, the attention mass its tokens
    received from the queries seen while the page was in the recent window (prefill: the
    chunk's observation window; decode: every decode step). A scorer reduces those statistics
    to scores `[H_kv, P]`; higher means keep. Sink tokens are handled by the selector, not here.
    """

    name: str

    @abstractmethod
    def page_scores(self, attn_sum: torch.Tensor, obs_count: torch.Tensor) -> torch.Tensor:
        """attn_sum: [..., H_kv, P] float32, summed GQA-reduced attention probabilities.
        obs_count: [..., P] float32, how many queries contributed to each token.
        Returns scores [..., H_kv, P] float32."""
