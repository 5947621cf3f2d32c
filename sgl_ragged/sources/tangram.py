"""TANGRAM (section 4.1): per layer and prefill chunk, the heads of a layer compete for a
global top-ceil(rho * H * n) of their tokens (Eq. 3); a head's budget is its mean retention over
the samples plus a margin (Eq. 5). The default source."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_ragged.scoring.select import select_flat_top_pages
from sgl_ragged.sources.margin import MarginSource


class TangramSource(MarginSource):
    """Eq. 3 per layer and chunk (the heads of a layer compete), Eq. 5 budgets per head."""

    name = "tangram"
    help = "Eq. 3 per head, budgets mu + alpha*sigma (default)"
    selection = "TANGRAM Eq. 3 per layer and prefill chunk; budgets Eq. 5"
    unnamed_records = True  # calibrated profiles written before "method" existed

    @property
    def output_prefix(self) -> str:
        return ""

    def chunk_kept(self, scores: Sequence[torch.Tensor], sinks: torch.Tensor,
                   rhos: Sequence[float]) -> torch.Tensor:  # fmt: skip
        per_layer = [  # [L] of [R, H]
            torch.stack([select_flat_top_pages(x, rho, sinks).sum((0, 2)) for rho in rhos])
            for x in scores
        ]
        return torch.stack(per_layer, dim=1)
