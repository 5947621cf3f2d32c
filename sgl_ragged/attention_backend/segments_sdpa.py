"""Attention of one head group over key segments on torch's CPU flash-attention kernel, for
the batched torch path: one call per segment (sealed hi slots, extend's sealed low tier, tail
tokens), each returning its output and log-sum-exp, merged exactly (out = Σ_seg exp(lse_seg -
lse) out_seg, lse = logsumexp_seg lse_seg) with decode's low-tier segment (segments.py). No
keys are concatenated, and the merged lse is what the window queries need for sealing.

Queries: q [B, H_p * G, Lq, D], query head h * G + g reading KV head h (the kernel's own GQA:
every code and key is read once per KV head, masks are not repeated per head). A chunk's G * Lq
query rows
outnumber a page's low tokens (and values' channels), so folding the low tier's parameters into
the query per page (decode's way) would build a larger tensor than the keys: extend instead
converts the codes to float32 once and applies scale and zero in place in one fused pass
(rounded once to the model dtype where that is not float32), in the layout the kernel reads.
"""

from __future__ import annotations

import torch

from sgl_ragged.mem_pool.quant import QuantTier, codes_into
from sgl_ragged.precision import LowPrecision

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""torch's CPU flash-attention kernel (what SDPA runs on the CPU), which also returns the
log-sum-exp [B, H, M] float32 (natural log). A query row that sees no key of a call gets output
0 and log-sum-exp 0; callers set those to -inf."""


def attend_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H_p * G, Lq, D], k, v [B, H_p, L, D] (any strides), bias [B, 1, Lq or 1, L]
    additive mask (0 or -inf), all in q's dtype -> out [B, H_p * G, Lq, D] in q's dtype, lse
    [B, H_p * G, Lq] float32."""
    return _flash(q, k, v, attn_mask=bias, scale=scale)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments' (out [*, M, D], lse [*, M] float32, -inf where the segment was empty) -> the
    attention over all of them: out float32 (0 for a row that saw nothing), lse float32."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)  # [*, M]
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    out = torch.zeros(parts[0][0].shape, dtype=torch.float32, device=lse.device)
    for o, part_lse in parts:
        out.addcmul_(o, torch.exp(part_lse - safe)[..., None])
    return out, lse


def dequantized_low(fmt: LowPrecision, tier: QuantTier, B: int, S: int, dtype: torch.dtype,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, H_p, S * lo, D] in `dtype` of a low tier of B * S pages (quant.py's
    shapes, pages request-major): codes converted to float32 once, scale (and zero) applied in
    place, then rounded once to `dtype` (no copy for float32)."""
    _, lo, H_p, _ = tier.k_codes.shape
    D = tier.k_scale.shape[-1]

    def dequantized(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    ) -> torch.Tensor:  # [B * S, lo, H_p, cb] -> [B, H_p, S * lo, D]
        src = packed.view(B, S, lo, H_p, -1).permute(0, 3, 1, 2, 4)
        out = torch.empty(B, H_p, S, lo, D, dtype=torch.float32, device=packed.device)
        codes_into(fmt, src, out)
        if zero is None:
            out.mul_(scale.float())
        else:  # in place: out aliases its input exactly
            torch.addcmul(zero.float(), out, scale.float(), out=out)
        return out.view(B, H_p, S * lo, D).to(dtype)

    # keys: per (page, head, channel) [B * S, H_p, D] -> [B, H_p, S, 1, D]
    k_par = [None if x is None else x.view(B, S, H_p, 1, D).transpose(1, 2)
             for x in (tier.k_scale, tier.k_zero)]
    # values: per (page, token, head) [B * S, lo, H_p] -> [B, H_p, S, lo, 1]
    v_par = [None if x is None else x.view(B, S, lo, H_p, 1).permute(0, 3, 1, 2, 4)
             for x in (tier.v_scale, tier.v_zero)]
    return dequantized(tier.k_codes, *k_par), dequantized(tier.v_codes, *v_par)
