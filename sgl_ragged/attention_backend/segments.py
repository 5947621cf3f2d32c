"""Decode attention of one head group over segmented keys, explicit and in float32, for the
batched torch path (extend runs on the CPU flash kernel instead: segments_sdpa.py).

A request's keys come in three segments, each producing its own logits into one logits buffer
(concatenated logits, never concatenated keys): the sealed rows' hi slots, their low tier
attended on the codes (DESIGN.md section 11, quant.py's formats) and the tail tokens. The
output is the sum of the segments' p·V products.

Rows: N = B * H_p (request b, KV head h of the group), each with M = Lq * G query rows (query i,
then query head g of KV head h; decode: Lq = 1). Logit columns of a request (S sealed pages
padded, T tail tokens):

    | columns                | segment | key                                             |
    |------------------------|---------|-------------------------------------------------|
    | [0, S * hi)            | hi      | hi slot j of sealed page s at s * hi + j        |
    | [S * hi, S * k)        | lo      | lo slot j of sealed page s at S * hi + s * lo + j |
    | [S * k, S * k + T)     | tail    | tail token t                                    |

Low tier on the codes: keys are quantized per (page, head, channel), so q·k_t = (q ⊙ s)·code_t +
q·z: the query is scaled once per page and one bias q·z is added per page. Values are quantized
per (token, head), so Σ p_t v_t = Σ (p_t s_t) code_t + Σ p_t z_t: the probabilities are scaled,
not the values. The codes are converted to float32 once; the G query heads of a KV head (the
M rows) share every code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ragged.mem_pool.quant import LowPrecision, QuantTier, codes_into


@dataclass(frozen=True)
class LowKV:
    """A group's low tier over a padded run: code values as float32 (converted once, not
    dequantized) and float32 parameters."""

    k_codes: torch.Tensor  # [N, S, lo, D] float32 code values
    k_scale: torch.Tensor  # [N, S, D] float32 per (page, channel)
    k_zero: torch.Tensor | None  # [N, S, D] float32 (int formats)
    v_codes: torch.Tensor  # [N, S * lo, D] float32 code values
    v_scale: torch.Tensor  # [N, S * lo] float32 per token
    v_zero: torch.Tensor | None  # [N, S * lo] float32 (int formats)


@dataclass(frozen=True)
class GroupKV:
    """One group's keys and values over a padded run of B requests, by segment (float32)."""

    hi_k: torch.Tensor  # [N, S * hi, D]
    hi_v: torch.Tensor  # [N, S * hi, D]
    low: LowKV | None
    tail_k: torch.Tensor  # [N, T, D]
    tail_v: torch.Tensor  # [N, T, D]
    unseen: torch.Tensor  # [B, Lq, L] bool: query i does not see logit column j

    @property
    def columns(self) -> int:
        """L: logit columns of a request."""
        return self.unseen.shape[-1]


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

    def codes(packed: torch.Tensor) -> torch.Tensor:  # [B * S, lo, H_p, cb] -> [N, S, lo, D]
        src = packed.view(B, S, lo, H_p, -1).permute(0, 3, 1, 2, 4)
        out = torch.empty(B, H_p, S, lo, D, dtype=torch.float32, device=packed.device)
        return codes_into(fmt, src, out).view(N, S, lo, D)

    def per_channel(x: torch.Tensor | None) -> torch.Tensor | None:  # [B * S, H_p, D]
        return None if x is None else as_f32(x.view(B, S, H_p, D).transpose(1, 2), (N, S, D))

    def per_token(x: torch.Tensor | None) -> torch.Tensor | None:  # [B * S, lo, H_p]
        return None if x is None else as_f32(x.view(B, S, lo, H_p).permute(0, 3, 1, 2), (N, S * lo))

    return LowKV(k_codes=codes(tier.k_codes), k_scale=per_channel(tier.k_scale),
                 k_zero=per_channel(tier.k_zero), v_codes=codes(tier.v_codes).view(N, S * lo, D),
                 v_scale=per_token(tier.v_scale), v_zero=per_token(tier.v_zero))


def attend(q: torch.Tensor, kv: GroupKV) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H_p, Lq, G, D] float32, pre-multiplied by the softmax scale -> out [B, H_p, Lq, G,
    D] float32 and lse [B, H_p, Lq, G] float32 (-inf for a query that sees nothing, whose
    output is 0)."""
    B, H_p, Lq, G, D = q.shape
    L = kv.columns
    # 1. Logits of every segment, into one buffer.
    logits = _logits(q.reshape(B * H_p, Lq * G, D), kv)  # [N, M, L]
    logits.view(B, H_p, Lq, G, L).masked_fill_(kv.unseen[:, None, :, None, :], float("-inf"))
    # 2. Softmax in place: logits become probabilities (0 for a query that sees nothing).
    lse = torch.logsumexp(logits, -1)  # [N, M]
    probs = logits.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    # 3. The segments' p·V products, summed.
    return _values(probs, kv).view(q.shape), lse.view(B, H_p, Lq, G)


def _logits(q: torch.Tensor, kv: GroupKV) -> torch.Tensor:
    """[N, M, L] float32 logits, segment after segment (module table)."""
    N, M, _ = q.shape
    n_hi, n_tail = kv.hi_k.shape[1], kv.tail_k.shape[1]
    logits = torch.empty(N, M, kv.columns, dtype=torch.float32, device=q.device)
    torch.bmm(q, kv.hi_k.transpose(1, 2), out=logits[:, :, :n_hi])
    if kv.low is not None:
        _low_logits(q, kv.low, logits[:, :, n_hi : kv.columns - n_tail])
    torch.bmm(q, kv.tail_k.transpose(1, 2), out=logits[:, :, kv.columns - n_tail :])
    return logits


def _low_logits(q: torch.Tensor, low: LowKV, out: torch.Tensor) -> None:
    """Logits of the low slots, out [N, M, S * lo] (a view into the logits buffer):
    (q ⊙ s_page)·code per page, then + q·z_page."""
    N, S, lo, _ = low.k_codes.shape
    per_page = torch.matmul(q[:, None] * low.k_scale[:, :, None, :], low.k_codes.transpose(2, 3))
    paged = out.view(N, q.shape[1], S, lo)
    paged.copy_(per_page.transpose(1, 2))  # [N, S, M, lo] -> [N, M, S, lo]
    if low.k_zero is not None:
        paged.add_(torch.bmm(q, low.k_zero.transpose(1, 2))[..., None])  # [N, M, S, 1]


def _values(probs: torch.Tensor, kv: GroupKV) -> torch.Tensor:
    """Σ over segments of p·V: probs [N, M, L] -> [N, M, D] float32."""
    n_hi, n_tail = kv.hi_k.shape[1], kv.tail_k.shape[1]
    out = torch.bmm(probs[:, :, :n_hi], kv.hi_v)
    out.baddbmm_(probs[:, :, kv.columns - n_tail :], kv.tail_v)
    low = kv.low
    if low is None:
        return out
    p_lo = probs[:, :, n_hi : kv.columns - n_tail]  # [N, M, S * lo]
    out.baddbmm_(p_lo * low.v_scale[:, None, :], low.v_codes)
    if low.v_zero is not None:
        out.add_(torch.bmm(p_lo, low.v_zero[..., None]))  # [N, M, 1]
    return out
