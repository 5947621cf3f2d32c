"""Budget sources other than TANGRAM's Eq. 3: KVCompose's layer-adaptive budgets and BaKlaVa's
head-importance reallocation (DESIGN.md section 5, papers/kvcompose.txt, papers/baklava.txt).

Both write the same profile format as the TANGRAM calibration and are served the same way: the
serving scorer still picks each head's tokens inside a page; only the per-head budgets differ.

- KVCompose (Eq. 16-22): per layer and prefill chunk, every KV head sorts its token scores
  (augmented with the mean over the layer's heads, Eq. 16); the k-th "composite token" of the
  layer scores the mean over heads of their k-th best scores (Eq. 19); a global top-ceil(rho * L
  * n) over all layers' composite tokens (Eq. 20-22) gives layer l its count N_l. Every head of a
  layer keeps N_l / n: budgets are uniform within a layer and adapt across layers.
- BaKlaVa (Algorithms 1-2): a head's importance is 1 - the normalized mean cosine similarity
  between its values v_i and its attention outputs o_i = softmax(q_i K^T) V (averaged over the
  query heads of a KV head); per layer, heads below the importance threshold t lose the fraction
  r of the uniform budget rho, and the k = min(n, H - n) most important heads share what the n
  reduced heads gave up. (r, t) come from a search over compressed perplexity (Algorithm 3,
  calibrate/compressed.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from sgl_ragged.calibrate.runner import LayerQKV
from sgl_ragged.scoring.snapkv import window_attention_probs

SOURCES = ("tangram", "kvcompose", "baklava")
"""--source of the calibrator: tangram (Eq. 3 per head, the default), kvcompose, baklava."""


# ----- KVCompose ----------------------------------------------------------------------------


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


# ----- BaKlaVa ------------------------------------------------------------------------------


def head_importance(layer: LayerQKV, scale: float) -> torch.Tensor:
    """BaKlaVa Algorithm 1 for one layer and prompt: [H_kv] float64 importance in [0, 1].

    Per query head, the mean over tokens of cos(v_i, o_i) with o_i the causal attention output
    of token i, normalized from [-1, 1] to [0, 1]; a KV head takes the mean over its query
    heads; importance = 1 - that similarity.
    """
    t, h_q, _ = layer.q.shape
    h_kv = layer.k.shape[1]
    group = h_q // h_kv
    pos = torch.arange(t, device=layer.q.device)
    probs = window_attention_probs(layer.q, layer.k, pos, pos, scale)  # [T, H_q, T] causal
    v = layer.v.float().repeat_interleave(group, dim=1)  # [T, H_q, D]
    out = torch.einsum("ihj,jhd->ihd", probs, v)  # [T, H_q, D]
    cos = torch.nn.functional.cosine_similarity(out, v, dim=-1, eps=1e-12)  # [T, H_q]
    similarity = (cos.double().mean(0) + 1.0) / 2.0  # [H_q] in [0, 1]
    return 1.0 - similarity.view(h_kv, group).mean(1)


def baklava_budgets(importance: np.ndarray, rho: float, reduction: float, threshold: float) -> np.ndarray:
    """BaKlaVa Algorithm 2 in every layer, from the uniform budget rho. [L, H] -> [L, H].

    Heads with importance < threshold lose ``reduction`` * rho; the k = min(n, H - n) most
    important of the others gain n * reduction * rho / k each; a layer whose heads are all below
    the threshold (or none) keeps rho everywhere. Budgets are capped at 1 (what a capped head
    cannot take is not spent: the mean budget is then below rho).
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"target retention rho must be in (0, 1], got {rho}")
    if not 0.0 <= reduction < 1.0:
        raise ValueError(f"BaKlaVa reduction r must be in [0, 1), got {reduction}")
    importance = np.asarray(importance, dtype=np.float64)
    out = np.full(importance.shape, float(rho))
    heads = importance.shape[1]
    for li, row in enumerate(importance):
        low = [h for h in range(heads) if row[h] < threshold]
        n = len(low)
        if n == 0 or n > heads - 1:
            continue
        # Top-k of the remaining heads by importance (ties towards the lower head index).
        high = sorted((h for h in range(heads) if h not in low), key=lambda h: (-row[h], h))
        k = min(n, heads - n)
        for h in low:
            out[li, h] = rho * (1.0 - reduction)
        for h in high[:k]:
            out[li, h] = rho + n * reduction * rho / k
    return np.minimum(out, 1.0)


def baklava_grid(importance: np.ndarray, reductions: Sequence[float],
                 quantiles: Sequence[float]) -> list[tuple[float, float]]:  # fmt: skip
    """Algorithm 3's parameter configurations: every (r, t) with t at the given quantiles of the
    model's head importances (the paper's grid of absolute thresholds, made model-relative),
    plus (0, 0): uniform, so the search can also conclude that reallocation does not help."""
    values = np.asarray(importance, dtype=np.float64).ravel()
    thresholds = sorted({round(float(np.quantile(values, q)), 9) for q in quantiles})
    grid = [(0.0, 0.0)]
    grid += [(float(r), t) for r in reductions if r > 0 for t in thresholds]
    return grid
