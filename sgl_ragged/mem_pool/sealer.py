"""Sealing: full pages leaving the recent window become rows (docs/architecture.md, "One forward pass" and "Row tiers").

One `Sealer` per storage does it for every caller (the torch reference, the batched paths,
finish-time sealing in the scheduler hook): score the pages (the scorer over their
`PageStats`), select per head (each group's tiers: the best `hi` tokens at the model dtype
or, with `--ragged-precision H+L`, quantized in H; the next `lo` quantized; sinks forced in; or TANGRAM Eq. 3 over the layer in the dynamic
reference mode), write the rows, count. The Triton path's sealer (triton_impl.TritonSealer)
differs only in `write`: the sealing kernel selects and scatters on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_ragged.scoring import PageStats, Scorer
from sgl_ragged.scoring.select import select_flat_top_pages, select_tiers, sink_mask

if TYPE_CHECKING:
    from sgl_ragged.mem_pool.storage import RaggedStorage


@dataclass(frozen=True)
class SealBatch:
    """N full pages of one layer leaving the window."""

    stats: PageStats  # what they observed; stats.keys, stats.values: their K/V [N, P, H, D]
    pages: torch.Tensor  # [N] int64 logical pages (-1: padding of a captured decode graph)
    page_start: torch.Tensor  # [N] int64 sequence position of each page's first token
    count: int  # pages the counters count now (host; 0 in a captured graph: graph.py counts)


class Sealer:
    """Scorer + per-head selection + row writes + seal counters, for one storage."""

    def __init__(self, storage: RaggedStorage, scorer: Scorer) -> None:
        self.storage = storage
        self.scorer = scorer

    def seal(self, layer: int, batch: SealBatch) -> None:
        """Score, select, write and count one layer's pages."""
        scores = self.scorer.page_scores(batch.stats)  # [N, H, P] float32
        kept = self.write(layer, batch.pages, batch.stats.keys, batch.stats.values, scores,
                          batch.page_start)
        self.count(layer, batch.count, kept)

    def write(self, layer: int, pages: torch.Tensor, k_tok: torch.Tensor, v_tok: torch.Tensor,
              scores: torch.Tensor, page_start: torch.Tensor) -> int | None:
        """Select per head and write the rows of full pages of one layer.

        pages: [N] int64 logical pages; k_tok, v_tok: [N, P, H, D] their full K/V (post-RoPE);
        scores: [N, H, P] float32 token scores; page_start: [N] int64 sequence position of
        each page's first token (sinks are the first tokens of a sequence). Returns the
        (token, KV head) entries kept where that depends on the data (dynamic mode), else None.
        """
        st = self.storage
        sinks = sink_mask(page_start, st.layout.page_size)
        if st.row_keep is not None:
            keep = select_flat_top_pages(scores, st.dynamic_rho, sinks)  # [N, H, P]
            st.write_full_rows(layer, pages, k_tok, v_tok, keep)
            return int(keep.sum())
        for g, t in enumerate(st.layout.tiers[layer]):
            heads = st.head_index[layer][g]
            hi_idx, lo_idx = select_tiers(scores[:, heads], t.hi, t.total, sinks)  # [N, H_p, *]
            k_g, v_g = k_tok[:, :, heads], v_tok[:, :, heads]  # [N, P, H_p, D]
            st.write_group(layer, g, pages, _gather_tokens(k_g, hi_idx), _gather_tokens(v_g, hi_idx))
            if t.lo:
                st.write_low(layer, g, pages, _gather_tokens(k_g, lo_idx), _gather_tokens(v_g, lo_idx))
        return None

    def count(self, layer: int, num_pages: int, kept: int | None = None) -> None:
        """Counters for `num_pages` pages of one layer written into their rows (kept: the
        entries kept when the layout does not fix them)."""
        layout, counters = self.storage.layout, self.storage.counters
        if kept is None:
            per_page = sum(k * len(heads) for heads, k in
                           zip(layout.groups[layer], layout.slots[layer], strict=True))
            kept = num_pages * per_page
        counters.entries_kept += kept
        counters.entries_seen += num_pages * layout.page_size * layout.num_kv_heads

    def seal_staged(self, pages: torch.Tensor, page_start: torch.Tensor) -> None:
        """Seal staged pages in every layer from their staging copies (outside a forward pass,
        e.g. at finish), then mark them sealed. pages, page_start: [N] int64 (CPU)."""
        if pages.numel() == 0:
            return
        st = self.storage
        stages = st.page_to_stage[pages].to(st.device)
        for layer in range(st.layout.num_layers):
            keys, values = st.stage_k[layer][stages], st.stage_v[layer][stages]
            stats = st.stats.page_stats(layer, stages, keys, values, st.scale)
            self.seal(layer, SealBatch(stats, pages.to(st.device), page_start.to(st.device),
                                       count=pages.numel()))
        st.mark_sealed(pages)


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [N, P, H, D], idx [N, H, k] token offsets per head -> [N, k, H, D]."""
    index = idx.transpose(1, 2).unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])
    return torch.gather(x, 1, index)
