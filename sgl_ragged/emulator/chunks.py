"""Serving's prefill chunks, offline: how a prompt is split and what each chunk's pages are
scored from.

A sample is split into prefill chunks as serving splits it. Each chunk's pages are scored exactly
as serving scores pages it seals in prefill: the attention of the chunk's last ``obs_window``
queries, max-reduced over the query heads of each KV head and summed, with per-token observation
counts and the window-query statistics, go into ``PageStats``; the scorer turns them into
``[N, H_kv, P]`` scores (the margin sources' retention, sources/margin.py, and the compressed
loss, compressed.py, select from them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ragged.emulator.runner import LayerQKV
from sgl_ragged.scoring import SINK_TOKENS, PageStats, page_query_stats
from sgl_ragged.scoring.select import sink_mask
from sgl_ragged.scoring.snapkv import gqa_reduce, window_attention_probs


@dataclass(frozen=True)
class ChunkingConfig:
    """How serving splits and scores a prompt."""

    page_size: int = 64  # tokens per logical page (--page-size)
    chunk_size: int = 512  # prefill chunk (--chunked-prefill-size), a multiple of page_size
    obs_window: int = 32  # last queries of a chunk that score it (--ragged-obs-window)

    def __post_init__(self) -> None:
        if self.page_size < SINK_TOKENS:
            raise ValueError(
                f"page size {self.page_size} is smaller than the {SINK_TOKENS} sink tokens; "
                f"use at least {SINK_TOKENS} (serving uses 64)"
            )
        if self.chunk_size < self.page_size or self.chunk_size % self.page_size:
            raise ValueError(
                f"chunk size {self.chunk_size} must be a positive multiple of the page size "
                f"{self.page_size}: serving compresses whole pages of each chunk"
            )
        if self.obs_window < 1:
            raise ValueError(f"observation window must be >= 1, got {self.obs_window}")

    def chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, end) of each prefill chunk of a ``num_tokens`` prompt (whole pages)."""
        if num_tokens < self.page_size or num_tokens % self.page_size:
            raise ValueError(
                f"a calibration sample must be whole pages of {self.page_size} tokens, got "
                f"{num_tokens}"
            )
        return [
            (start, min(start + self.chunk_size, num_tokens))
            for start in range(0, num_tokens, self.chunk_size)
        ]


def chunk_page_stats(
    layer: LayerQKV, start: int, end: int, cfg: ChunkingConfig, scale: float
) -> PageStats:
    """``PageStats`` of the pages of chunk [start, end) of one layer, as serving builds them."""
    h_kv, dim = layer.k.shape[1:]
    n, p = end - start, cfg.page_size
    w = min(cfg.obs_window, n)
    device = layer.q.device
    q_pos = torch.arange(end - w, end, device=device)  # [w] window query positions
    tok_pos = torch.arange(start, end, device=device)  # [n] chunk token positions
    # 1. Window attention over every key before the chunk's end, GQA-reduced, summed.
    probs = window_attention_probs(layer.q[end - w : end], layer.k[:end], q_pos,
                                   torch.arange(end, device=device), scale)  # fmt: skip
    attn = gqa_reduce(probs, h_kv)[:, :, start:end].sum(0)  # [H_kv, n]
    # 2. How many window queries saw each token (the causal mask).
    obs = (q_pos[:, None] >= tok_pos[None, :]).sum(0).float()  # [n]
    # 3. Statistics of the window queries that saw each page (pooled per KV head).
    pages = n // p
    q_sum, q_sq, count = page_query_stats(layer.q[end - w : end], q_pos, tok_pos[::p], h_kv)
    return PageStats(
        attn_sum=attn.view(h_kv, pages, p).transpose(0, 1).contiguous(),  # [N, H_kv, P]
        obs_count=obs.view(pages, p),
        keys=layer.k[start:end].view(pages, p, h_kv, dim),
        values=layer.v[start:end].view(pages, p, h_kv, dim),
        q_sum=q_sum,
        q_sq_sum=q_sq,
        q_count=count,
        scale=scale,
    )


def chunk_sinks(start: int, pages: int, page_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, P] bool sink tokens of the ``pages`` consecutive pages starting at position ``start``."""
    return sink_mask(start + page_size * torch.arange(pages, device=device), page_size)
