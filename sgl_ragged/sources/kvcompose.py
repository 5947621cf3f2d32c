"""KVCompose (papers/kvcompose.txt, Eq. 16-22): layer-adaptive budgets, uniform within a layer.

Per layer and prefill chunk, every KV head sorts its token scores (augmented with the mean over
the layer's heads, Eq. 16); the k-th "composite token" of the layer scores the mean over heads
of their k-th best scores (Eq. 19); a global top-ceil(rho * L * n) over all layers' composite
tokens (Eq. 20-22) gives layer l its count N_l. Every head of a layer keeps N_l / n: budgets
are uniform within a layer and adapt across layers (then Eq. 5 over the samples, as TANGRAM's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sgl_ragged.sources.margin import MarginSource


class KVComposeSource(MarginSource):
    """The layers compete through their composite tokens; a layer's heads share its count."""

    name = "kvcompose"
    help = "layer-adaptive budgets, uniform within a layer (H_p = H)"
    selection = ("KVCompose Eq. 16-22 (layer-adaptive composite tokens) per prefill chunk; "
                 "budgets Eq. 5 over the per-layer retention")

    def default_heads_per_group(self, model_path: str) -> int:
        """All KV heads of a layer in one group: its heads' budgets are equal."""
        from sgl_ragged.profile import model_shape

        return model_shape(model_path).num_kv_heads

    def chunk_kept(self, scores: Sequence[torch.Tensor], sinks: torch.Tensor,
                   rhos: Sequence[float]) -> torch.Tensor:  # fmt: skip
        composite = [composite_scores(x, sinks) for x in scores]
        heads = scores[0].shape[1]
        return layer_kept_counts(composite, rhos)[:, :, None].expand(-1, -1, heads)


def composite_scores(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """KVCompose Eq. 16-19 for one layer's chunk: the importance of each composite token.

    scores: [N, H, P] page scores of the chunk's N pages; sinks: [N, P] bool (always kept).
    Returns [N * P] float32, descending: entry k is the mean over heads of each head's k-th best
    augmented score (Eq. 16: a token's score plus the mean of that token's scores over heads).
    """
    n, h, p = scores.shape
    flat = scores.transpose(0, 1).reshape(h, n * p).float()  # [H, T] in position order
    augmented = flat + flat.mean(0, keepdim=True)  # Eq. 16
    augmented = augmented.masked_fill(sinks.flatten()[None, :], float("inf"))
    ranked = torch.sort(augmented, dim=1, descending=True).values  # Eq. 17-18
    return ranked.mean(0)  # Eq. 19 (mean over heads); sinks rank first with +inf


def layer_kept_counts(composite: Sequence[torch.Tensor], rhos: Sequence[float]) -> torch.Tensor:
    """Eq. 20-22: tokens each layer keeps per head, for each rho.

    composite: [L] of [T] descending composite scores of the same chunk (composite_scores).
    Returns [R, L] int64 N_l; sum_l N_l = ceil(rho * L * T) (at least every layer's sinks).
    Ties break towards lower (layer, rank) index, deterministically.
    """
    layers, tokens = len(composite), composite[0].numel()
    pool = torch.cat([c.float() for c in composite])  # [L * T], layer-major
    order = torch.sort(pool, descending=True, stable=True).indices
    forced = int(torch.isinf(pool).sum())
    out = torch.empty(len(rhos), layers, dtype=torch.int64)
    for ri, rho in enumerate(rhos):
        budget = min(layers * tokens, max(math.ceil(rho * layers * tokens), forced))
        out[ri] = torch.bincount(order[:budget] // tokens, minlength=layers)
    return out
