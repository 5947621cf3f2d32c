"""Segmented attention of the batched torch path (segments.py, segments_sdpa.py) against dense
attention over dequantized keys and values in float64, on fresh random inputs: every low
precision, GQA 1 and 3, padded sealed pages, requests without sealed pages and queries that see
nothing."""

from __future__ import annotations

import pytest
import torch

from sgl_ragged.attention_backend.segments import attend_low, low_kv
from sgl_ragged.attention_backend.segments_sdpa import attend_segment, dequantized_low, merge
from sgl_ragged.mem_pool.quant import QuantTier, dequantize, quantize
from sgl_ragged.precision import LOW_PRECISIONS

B, S, LO, HI, T, H_P, D = 3, 4, 6, 2, 9, 2, 16  # T > Lq: every query sees its own token
NUM_SEALED = torch.tensor([4, 0, 2])  # request 1 has no sealed pages; request 2 two of S = 4


def _tier(name: str, gen: torch.Generator) -> QuantTier:
    """Low tiers of B * S pages from random K/V through the quantizer (real codes)."""
    k, v = (torch.randn(B * S, LO, H_P, D, generator=gen) * 2 + 0.5 for _ in range(2))
    return quantize(LOW_PRECISIONS[name], k, v)


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, unseen: torch.Tensor,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention: q [B, H_p, Lq, G, D] (scaled), keys/values [B, H_p, L, D], unseen
    [B, Lq, L] -> out [B, H_p, Lq, G, D] (0 where nothing is seen), lse [B, H_p, Lq, G]."""
    logits = torch.einsum("bhqgd,bhld->bhqgl", q.double(), keys.double())
    logits = logits.masked_fill(unseen[:, None, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqgl,bhld->bhqgd", probs, values.double()), lse


def _case(name: str, Lq: int, G: int, seed: int):
    """Random hi rows, low tier, tail and queries; the dense keys/values in logit order."""
    gen = torch.Generator().manual_seed(seed)
    fmt, tier = LOW_PRECISIONS[name], _tier(name, gen)
    hi_k, hi_v, tail_k, tail_v = (torch.randn(B, H_P, n, D, generator=gen)
                                  for n in (S * HI, S * HI, T, T))
    lo_k, lo_v = dequantize(fmt, tier, torch.float64)  # [B * S, LO, H_p, D]
    lo_k, lo_v = (x.view(B, S * LO, H_P, D).transpose(1, 2) for x in (lo_k, lo_v))
    keys = torch.cat([hi_k.double(), lo_k, tail_k.double()], 2)
    values = torch.cat([hi_v.double(), lo_v, tail_v.double()], 2)
    # Sealed columns exist for the request's pages; query i sees tail tokens t <= i + T - Lq.
    sealed = torch.cat([torch.arange(S * n)[None, :] >= NUM_SEALED[:, None] * n for n in (HI, LO)], 1)
    causal = torch.arange(T)[None, :] > torch.arange(Lq)[:, None] + T - Lq  # [Lq, T]
    unseen = torch.cat([sealed[:, None, :].expand(B, Lq, -1), causal.expand(B, Lq, T)], 2)
    unseen[0, 0] = True  # a query that sees nothing: output 0
    q = torch.randn(B, H_P, Lq, G, D, generator=gen) * 0.3
    return fmt, tier, (hi_k, hi_v, tail_k, tail_v), keys, values, unseen, q


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
@pytest.mark.parametrize("M", [1, 3, 8])
def test_low_tier_on_the_codes_matches_dense_attention(name, M):
    """segments.attend_low: the low tier's parameters folded into the query (per page, plus a
    bias) and the probabilities, against attention over the dequantized tier."""
    gen = torch.Generator().manual_seed(11)
    fmt, tier = LOW_PRECISIONS[name], _tier(name, gen)
    lo_k, lo_v = dequantize(fmt, tier, torch.float64)  # [B * S, LO, H_p, D]
    keys, values = (x.view(B, S * LO, H_P, D).transpose(1, 2) for x in (lo_k, lo_v))
    unseen = torch.arange(S * LO)[None, None, :] >= NUM_SEALED[:, None, None] * LO  # [B, 1, S * LO]
    q = torch.randn(B, H_P, M, 1, D, generator=gen) * 0.3
    out, lse = attend_low(q.view(B * H_P, M, D), low_kv(fmt, tier, B, S), unseen)
    want_out, want_lse = _dense(q, keys, values, unseen.expand(B, M, -1))
    # float32 against float64: folding scales reorders the float32 products (seen: ~1e-6)
    torch.testing.assert_close(out.double().view(want_out.shape), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double().view(want_lse.shape), want_lse, atol=1e-5, rtol=1e-5)
    assert out.view(B, H_P, M, D)[1].abs().max() == 0 and torch.isinf(lse.view(B, H_P, M)[1]).all()


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_segments_merge_to_dense_attention(name, dtype):
    """segments_sdpa: one flash call per segment (low tier dequantized once in `dtype`),
    merged by log-sum-exp = dense attention (the kernel's GQA: query head h * G + g)."""
    Lq, G = 7, 3
    fmt, tier, (hi_k, hi_v, tail_k, tail_v), keys, values, unseen, q = _case(name, Lq, G, 12)
    unseen[0, 0] = False  # the flash kernel's empty rows are the callers' business (below)
    lo_k, lo_v = dequantized_low(fmt, tier, B, S, dtype)  # [B, H_p, S * LO, D]
    q_heads = q.permute(0, 1, 3, 2, 4).reshape(B, H_P * G, Lq, D).to(dtype)  # head h * G + g
    parts, start = [], 0
    empty = torch.where(NUM_SEALED > 0, 0.0, float("-inf"))[:, None, None]
    for k, v, sealed in ((hi_k, hi_v, True), (lo_k, lo_v, True), (tail_k, tail_v, False)):
        cols = unseen[:, :, start : start + k.shape[2]]  # [B, Lq, n]
        start += k.shape[2]
        bias = torch.zeros(cols.shape, dtype=dtype).masked_fill_(cols, float("-inf"))[:, None]
        out_s, lse_s = attend_segment(q_heads, k.to(dtype), v.to(dtype), bias, 1.0)
        parts.append((out_s, lse_s + empty if sealed else lse_s))
    out, lse = merge(parts)
    want_out, want_lse = _dense(q.to(dtype), keys, values, unseen)
    out = out.view(B, H_P, G, Lq, D).transpose(2, 3)
    lse = lse.view(B, H_P, G, Lq).transpose(2, 3)
    # float32: the kernel's blocked sums (seen: 2e-6). bfloat16: keys, values and each
    # segment's output are rounded to bfloat16 (8-bit significand) before the float32 merge;
    # seen: 0.027 at outputs up to 5, under one bfloat16 step there (2^-5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_low_is_dequantize_rounded_once(name, dtype):
    """The extend path's low keys/values equal quant.dequantize's in `dtype`, rearranged."""
    fmt, tier = LOW_PRECISIONS[name], _tier(name, torch.Generator().manual_seed(5))
    lo_k, lo_v = dequantized_low(fmt, tier, B, S, dtype)
    want_k, want_v = dequantize(fmt, tier, dtype)  # [B * S, LO, H_p, D]
    for got, want in ((lo_k, want_k), (lo_v, want_v)):
        want = want.view(B, S * LO, H_P, D).transpose(1, 2)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
