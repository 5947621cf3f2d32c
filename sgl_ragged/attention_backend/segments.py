"""Decode attention over a group's low tier, on its codes (docs/architecture.md, "Row tiers"): the low-tier
segment of the batched torch path, explicit and in float32 (the other segments, and extend's
low tier, run on the CPU flash kernel: segments_sdpa.py; their results merge by log-sum-exp).

Keys are quantized per (page, head, channel), so q·k_t = (q ⊙ s)·code_t + q·z: the query is
scaled once per page and one bias q·z is added per page. Values are quantized per (token,
head), so Σ p_t v_t = Σ (p_t s_t) code_t + Σ p_t z_t: the probabilities are scaled, not the
values. The codes are converted to float32 once, plane by plane (quant.py's planar packing:
plane j holds channels [j * D / P, (j + 1) * D / P) of all tokens, P = 8 / bits; a contiguous
copy per plane is the cheapest conversion), and never dequantized; the M query rows of a KV
head (its G query heads) share every code.

Rows: N = B * H_p (request b, KV head h of the group), M query rows each. Logit column
s * lo + j is low slot j of sealed page s (S pages, padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ragged.mem_pool.quant import QuantTier, code_planes_into
from sgl_ragged.precision import LowPrecision


@dataclass(frozen=True)
class LowKV:
    """A group's low tier over a padded run: code values as float32 planes (converted once,
    not dequantized) and float32 parameters."""

    k_codes: torch.Tensor  # [P, N, S, lo, D / P] float32 code values, plane j first
    k_scale: torch.Tensor  # [N, S, D] float32 per (page, channel)
    k_zero: torch.Tensor | None  # [N, S, D] float32 (int formats)
    v_codes: torch.Tensor  # [P, N, S * lo, D / P] float32 code values
    v_scale: torch.Tensor  # [N, S * lo] float32 per token
    v_zero: torch.Tensor | None  # [N, S * lo] float32 (int formats)


def as_f32(x: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """x (any layout) as a contiguous float32 tensor of `shape` (default x's): a view when it
    is one already, else one copy that converts and lays out together."""
    if not (x.dtype == torch.float32 and x.is_contiguous()):
        x = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    return x.view(x.shape if shape is None else shape)


def low_kv(fmt: LowPrecision, tier: QuantTier, B: int, S: int) -> LowKV:
    """The low tier of B * S pages (tier in quant.py's shapes, pages = B * S, request-major),
    rearranged per (request, KV head)."""
    _, lo, H_p, _ = tier.k_codes.shape
    D = tier.k_scale.shape[-1]
    N = B * H_p

    def codes(packed: torch.Tensor) -> torch.Tensor:  # [B * S, lo, H_p, cb] -> [P, N, S, lo, D / P]
        src = packed.view(B, S, lo, H_p, -1).permute(0, 3, 1, 2, 4)
        per = 8 // fmt.bits
        out = torch.empty(per, B, H_p, S, lo, D // per, dtype=torch.float32, device=packed.device)
        return code_planes_into(fmt, src, out).view(per, N, S, lo, D // per)

    def per_channel(x: torch.Tensor | None) -> torch.Tensor | None:  # [B * S, H_p, D]
        return None if x is None else as_f32(x.view(B, S, H_p, D).transpose(1, 2), (N, S, D))

    def per_token(x: torch.Tensor | None) -> torch.Tensor | None:  # [B * S, lo, H_p]
        return None if x is None else as_f32(x.view(B, S, lo, H_p).permute(0, 3, 1, 2), (N, S * lo))

    return LowKV(k_codes=codes(tier.k_codes), k_scale=per_channel(tier.k_scale),
                 k_zero=per_channel(tier.k_zero), v_codes=codes(tier.v_codes).flatten(2, 3),
                 v_scale=per_token(tier.v_scale), v_zero=per_token(tier.v_zero))


def attend_low(q: torch.Tensor, low: LowKV, unseen: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, M, D] float32 (pre-multiplied by the softmax scale) over the low
    tier alone; unseen [B, 1 or M, S * lo] bool hides padded pages. Returns out [N, M, D]
    float32 (0 for a row that sees nothing) and lse [N, M] float32 (-inf there)."""
    N, M, D = q.shape
    B, per = unseen.shape[0], low.k_codes.shape[0]
    # 1. Logits on the codes: (q ⊙ s_page)·code per page and plane, [N, S, M, lo], + q·z_page.
    scaled = (q[:, None] * low.k_scale[:, :, None, :]).unflatten(-1, (per, -1))  # [N, S, M, P, D/P]
    logits = torch.matmul(scaled.movedim(3, 0), low.k_codes.transpose(-1, -2))  # [P, N, S, M, lo]
    logits = logits[0] if per == 1 else logits.sum(0)
    if low.k_zero is not None:
        logits.add_(torch.bmm(q, low.k_zero.transpose(1, 2)).transpose(1, 2)[..., None])
    logits = logits.transpose(1, 2).reshape(N, M, -1)  # [N, M, S * lo]
    logits.view(B, N // B, M, -1).masked_fill_(unseen[:, None], float("-inf"))
    # 2. Softmax in place: logits become probabilities.
    lse = torch.logsumexp(logits, -1)  # [N, M]
    probs = logits.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    # 3. Σ (p_t s_t) code_t per plane (its channels), + Σ p_t z_t.
    out = torch.matmul(probs * low.v_scale[:, None, :], low.v_codes)  # [P, N, M, D / P]
    out = out.movedim(0, 2).reshape(N, M, D)
    if low.v_zero is not None:
        out.add_(torch.bmm(probs, low.v_zero[..., None]))  # [N, M, 1]
    return out, lse
