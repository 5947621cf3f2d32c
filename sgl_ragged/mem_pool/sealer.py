"""Sealing decisions: which tokens of full pages leaving the recent window their rows keep
(docs/architecture.md, "One sealed page" and "Row tiers").

The `Sealer` decides and the storage writes: `Sealer.select` scores the pages (the scorer over
their `PageStats`), forces the sinks in and returns a `Selection`; `RaggedStorage.seal`
(storage.py) writes the rows it describes through the storage's row writer and counts them
with `Sealer.entries`. The sealer holds no storage: it takes the layout (each group's tiers),
the scorer and the row policy of the mode. There is one per server: the storage builds it
from its constructor's scorer and mode (`RaggedStorage.sealer`), every path seals through it.

Row policies:

    | policy         | mode                       | what a Selection decides                         |
    |----------------|----------------------------|--------------------------------------------------|
    | `TierRows`     | budget profiles (default)  | per head of group g: the hi[l][g] best tokens by |
    |                |                            | score (sinks first, ties to the earlier), then   |
    |                |                            | the next lo[l][g] (`tier_tokens`)                |
    | `DynamicRows`  | dynamic:<rho> (reference)  | `keep` [N, H, P]: TANGRAM Eq. 3 over all heads   |
    |                |                            | of the layer, full rows with keep masks          |

Under `TierRows` the selection is the rule plus its inputs (scores, sinks), not index tensors:
the torch row writer applies it per group (`tier_tokens`, select_tiers), the Triton sealing
kernel applies the same ranks on the device (kernels/seal.py; tests/unit/test_kernels_seal.py
checks that both write the same rows), so the device path computes no torch top-k it would not
read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.scoring import PageStats, Scorer
from sgl_ragged.scoring.select import select_flat_top_pages, select_tiers, sink_mask


@dataclass(frozen=True)
class SealBatch:
    """N full pages of one layer leaving the window."""

    stats: PageStats  # what they observed; stats.keys, stats.values: their K/V [N, P, H, D]
    pages: torch.Tensor  # [N] int64 logical pages (-1: padding of a captured decode graph)
    page_start: torch.Tensor  # [N] int64 sequence position of each page's first token
    count: int  # pages the counters count now (host; 0 in a captured graph: graph.py counts)


@dataclass(frozen=True)
class Selection:
    """What the rows of N pages of one layer keep (the Sealer's decision, the storage writes it)."""

    scores: torch.Tensor  # [N, H, P] float32 token scores (the scorer's)
    sinks: torch.Tensor  # [N, P] bool tokens kept whatever their score (a sequence's first)
    keep: torch.Tensor | None = None  # [N, H, P] bool, DynamicRows only: the kept tokens


@dataclass(frozen=True)
class TierRows:
    """Budget profiles: each group keeps its tiers' best tokens per head (module table)."""


@dataclass(frozen=True)
class DynamicRows:
    """The dynamic reference mode: TANGRAM Eq. 3 over all heads of a layer at ratio rho."""

    rho: float


RowPolicy = TierRows | DynamicRows


class Sealer:
    """Scorer + selection rule + entry counts; one per server (`RaggedStorage.sealer`)."""

    def __init__(self, layout: RaggedLayout, scorer: Scorer, policy: RowPolicy = TierRows()) -> None:
        self.layout = layout
        self.scorer = scorer
        self.policy = policy

    def select(self, stats: PageStats, page_start: torch.Tensor) -> Selection:
        """The selection of N pages from what they observed; page_start: [N] int64 sequence
        position of each page's first token (sinks are the first tokens of a sequence)."""
        return self.choose(self.scorer.page_scores(stats), page_start)

    def choose(self, scores: torch.Tensor, page_start: torch.Tensor) -> Selection:
        """The selection of N pages from their token scores [N, H, P] float32."""
        sinks = sink_mask(page_start, self.layout.page_size)  # [N, P]
        if isinstance(self.policy, DynamicRows):
            return Selection(scores, sinks, select_flat_top_pages(scores, self.policy.rho, sinks))
        return Selection(scores, sinks)

    def entries(self, layer: int, num_pages: int, selection: Selection | None = None) -> tuple[int, int]:
        """(token, KV head) entries kept and offered by `num_pages` pages of one layer: the
        layout fixes the kept ones except in the dynamic mode (its selection counts them)."""
        layout = self.layout
        if selection is not None and selection.keep is not None:
            kept = int(selection.keep.sum())
        else:
            kept = num_pages * sum(k * len(heads) for heads, k in
                                   zip(layout.groups[layer], layout.slots[layer], strict=True))
        return kept, num_pages * layout.page_size * layout.num_kv_heads


def tier_tokens(selection: Selection, heads: torch.Tensor | slice,
                tiers: RowTiers) -> tuple[torch.Tensor, torch.Tensor]:
    """Token offsets one group keeps under TierRows: hi_idx [N, H_p, hi] and lo_idx
    [N, H_p, lo] int64 per member head (heads: its H_p KV heads, an index or a slice), each in
    position order."""
    return select_tiers(selection.scores[:, heads], tiers.hi, tiers.total, selection.sinks)
