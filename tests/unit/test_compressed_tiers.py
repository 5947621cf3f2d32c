"""The offline emulator's row tiers (emulator/compressed.py, docs/architecture.md, "Row tiers") against a
brute force: every query of a chunk attends to its own chunk at full precision and to earlier
chunks' kept tokens as the server's rows hold them (hi tokens exact, lo tokens quantized per
page and head, dropped tokens hidden); SGLang's stock FP8 cache casts them instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgl_ragged.emulator.chunks import chunk_page_stats
from sgl_ragged.emulator.compressed import CompressedLoss, StockFp8, TierSelection
from sgl_ragged.emulator.runner import CaptureRunner, LayerQKV
from sgl_ragged.emulator.samples import build_samples
from sgl_ragged.mem_pool.quant import dequantize, quantize
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.precision import LOW_PRECISIONS, LowPrecision
from sgl_ragged.scoring import SINK_TOKENS, make_scorer
from tests.unit.test_sources import TINY


def _requant(fmt: LowPrecision, k: torch.Tensor, v: torch.Tensor, h: int, pos: list[int]) -> None:
    """Head h's tokens at positions pos of K, V [H, T, D] quantized as one tier, in place."""
    deq_k, deq_v = dequantize(fmt, quantize(fmt, k[h, pos][None, :, None], v[h, pos][None, :, None]),
                              torch.float32)
    k[h, pos], v[h, pos] = deq_k[0, :, 0], deq_v[0, :, 0]


def brute_sealed(layer: LayerQKV, tiers: list[RowTiers], fmt: LowPrecision | None, scale: float,
                 hi_fmt: LowPrecision | None = None):
    """[H, T] keep mask and K, V [H, T, D] as later chunks read them, page by page, head by
    head, with the ranking written out (sinks first in position order, then by score); the lo
    tier quantized in fmt, the hi tier in hi_fmt (None: kept exact), each tier on its own."""
    k, v = layer.k.transpose(0, 1).clone(), layer.v.transpose(0, 1).clone()  # [H, T, D]
    h_kv, n_tok = k.shape[:2]
    keep = torch.ones(h_kv, n_tok, dtype=torch.bool)
    p = TINY.page_size
    scorer = make_scorer("snapkv")
    for start, end in TINY.chunks(n_tok)[:-1]:
        scores = scorer.page_scores(chunk_page_stats(layer, start, end, TINY, scale))  # [N, H, P]
        for page in range((end - start) // p):
            base = start + page * p
            for h in range(h_kv):
                t = tiers[h]
                ranked = sorted(range(p), key=lambda o, page=page, h=h: (
                    base + o >= SINK_TOKENS, 0.0 if base + o < SINK_TOKENS else -float(scores[page, h, o]), o))
                for o in range(p):
                    keep[h, base + o] = o in ranked[: t.total]
                for tier_fmt, part in ((hi_fmt, ranked[: t.hi]), (fmt, ranked[t.hi : t.total])):
                    if tier_fmt is not None and part:
                        _requant(tier_fmt, k, v, h, [base + o for o in sorted(part)])
    return keep, k, v


def assert_per_query_softmax(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             sealed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                             scale: float) -> None:
    """out [H_q, T, D] of the emulator's attention (q [H_q, T, D], k, v [H, T, D], GQA 2,
    32-token chunks) against one softmax per query: its own chunk exact, earlier chunks' kept
    tokens as `sealed` = brute_sealed(...) reads them."""
    keep, k_sealed, v_sealed = sealed
    for hq in range(q.shape[0]):
        h = hq // 2
        for i in range(q.shape[1]):
            own = [(k[h, j], v[h, j]) for j in range(i + 1) if j // 32 == i // 32]
            old = [(k_sealed[h, j], v_sealed[h, j]) for j in range(i + 1) if j // 32 != i // 32 and keep[h, j]]
            keys, values = zip(*(own + old), strict=True)
            w = torch.softmax(torch.stack([q[hq, i] @ kj for kj in keys]) * scale, 0)
            want = sum(wj * vj for wj, vj in zip(w, values, strict=True))
            torch.testing.assert_close(out[hq, i], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("precision", ["int4", "int2", "fp8"])
def test_tier_attention_matches_per_query_softmax(tiny_llama: Path, precision: str) -> None:
    runner = CaptureRunner(str(tiny_llama))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(h, 64, 8, generator=gen) for h in (4, 2, 2))
    tiers = [[RowTiers(2, 7), RowTiers(0, 16)], [RowTiers(16, 0), RowTiers(1, 3)]]
    fmt = LOW_PRECISIONS[precision]
    out = loss._attention(TierSelection(tiers, fmt))(0, q, k, v)
    layer = LayerQKV(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    assert_per_query_softmax(out, q, k, v, brute_sealed(layer, tiers[0], fmt, runner.scale),
                             runner.scale)


def test_full_tiers_are_the_model_and_stock_fp8_is_close(tiny_llama: Path) -> None:
    runner = CaptureRunner(str(tiny_llama))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    (sample,) = build_samples(runner.tokenizer, 1, 0, 96, 96, 16)
    full = loss.token_nll(sample.input_ids, None)
    every = [[RowTiers(16, 0)] * 2] * 2
    torch.testing.assert_close(loss.token_nll(sample.input_ids, TierSelection(every, None)), full,
                               atol=1e-5, rtol=1e-5)
    int8 = [[RowTiers(0, 16)] * 2] * 2
    near = loss.token_nll(sample.input_ids, TierSelection(int8, LOW_PRECISIONS["int8"]))
    assert not torch.equal(near, full) and torch.allclose(near, full, atol=0.05)
    fp8 = loss.token_nll(sample.input_ids, StockFp8())
    assert fp8.isfinite().all() and not torch.equal(fp8, full)
    x = torch.randn(2, 16, 2, 8) * 10
    sealed_k, sealed_v = StockFp8().sealed_kv(0, torch.rand(2, 2, 16), torch.zeros(2, 16, dtype=torch.bool), x, -x)
    want = x.to(torch.float8_e4m3fn).float()  # scale 1: SGLang's cache without scales
    assert torch.equal(sealed_k, want) and torch.equal(sealed_v, -want)
