"""Batched torch attention (the CPU default) against the per-request torch reference.

Random batches of requests with sealed rows, staged tokens and new tokens (decode batches,
prefill chunks and mixed batches, with unowned rows between requests), on twin storages:
outputs, rows, staging pages, statistics and counters must agree.
"""

from __future__ import annotations

import random

import pytest
import torch

from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention, padded_batches
from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from tests.unit.kernel_cases import (
    P,
    Shape,
    Spec,
    assert_same_state,
    compare_with_reference,
    random_plans,
    random_qkv,
    random_specs,
    random_storage,
)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("decode", [False, True])
def test_batched_matches_reference(seed, decode):
    rng = random.Random(seed)
    specs = random_specs(rng, rng.randint(1, 6), decode)
    compare_with_reference(BatchedTorchAttention, specs, decode, seed, "cpu", layer=seed % 2,
                           gap=seed % 3)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("decode", [False, True])
def test_batched_matches_reference_with_low_precision_tiers(precision, decode):
    """Rows with a quantized tier (docs/architecture.md, "Row tiers"): both paths dequantize the same rows
    and seal through the same quantizer."""
    for seed in range(3):
        rng = random.Random(100 + seed)
        specs = random_specs(rng, rng.randint(1, 5), decode)
        compare_with_reference(BatchedTorchAttention, specs, decode, 100 + seed, "cpu",
                               layer=seed % 2, gap=seed % 2, precision=precision)


@pytest.mark.parametrize("specs,decode", [
    ([Spec(sealed=0, staged=0, q_len=1)], True),  # a lone first token
    ([Spec(sealed=3, staged=0, q_len=1), Spec(0, 2 * P - 1, 1, seal=1)], True),
    ([Spec(sealed=0, staged=0, q_len=3 * P, seal=3), Spec(5, P, 1)], False),  # mixed batch
    ([Spec(sealed=2, staged=3, q_len=2 * P + 1, seal=1)], False),
])
def test_batched_edge_cases(specs, decode):
    compare_with_reference(BatchedTorchAttention, specs, decode, 7, "cpu", layer=1, gap=2)


def test_long_chunks_run_apart_from_short_requests():
    """A small padding cap splits the batch into runs; results stay the reference's."""
    rng = random.Random(5)
    specs = [Spec(1, 3, 3 * P, seal=2), Spec(2, 5, 2), Spec(0, 0, 1), Spec(3, P + 1, 7, seal=1)]
    compare_with_reference(lambda st: BatchedTorchAttention(st, max_padded=4 * P * P), specs,
                           False, rng.randrange(99), "cpu", layer=1, gap=1)


def test_padded_runs_respect_the_cap():
    storage = random_storage(random.Random(2), "cpu", num_stages=64)
    specs = [Spec(1, 3, 3 * P, seal=2), Spec(2, 5, 2), Spec(0, 0, 1), Spec(3, P + 1, 7, seal=1)]
    plans = random_plans(storage, specs, random.Random(2))
    cap = 4 * P * P
    runs = padded_batches(plans, P, torch.device("cpu"), max_padded=cap)
    assert sum(pb.q_row.shape[0] for pb in runs) == len(plans) and len(runs) > 1
    for pb in runs:
        B, Lq = pb.q_row.shape
        keys = (pb.sealed_table.shape[1] + pb.tail_page.shape[1]) * P
        assert B == 1 or B * Lq * keys <= cap
    assert len(padded_batches(plans, P, torch.device("cpu"))) == 1  # default cap: one run


@pytest.mark.parametrize("limit,inside", [(2**17, 1), (0, 2)])
def test_small_forwards_attend_on_one_thread(monkeypatch, limit, inside):
    """Below SINGLE_THREAD_PAIRS the layer runs on one intra-op thread (the count is restored
    after it); above, on the process's threads. Results are the reference's either way."""
    from sgl_ragged.attention_backend import batched_torch

    seen, forward = [], BatchedTorchAttention._forward

    def spy(self, *args):
        seen.append(torch.get_num_threads())
        return forward(self, *args)

    monkeypatch.setattr(BatchedTorchAttention, "_forward", spy)
    monkeypatch.setitem(batched_torch.SINGLE_THREAD_PAIRS, True, limit)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        compare_with_reference(BatchedTorchAttention, [Spec(2, 3, 1), Spec(0, 5, 1)], True, 3,
                               "cpu")
        assert seen == [inside] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "int2", "fp8", "int8+int4", "fp8+int2"])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("dtype,gqa,heads_per_group", [
    (torch.float32, 1, 2), (torch.float32, 3, 1), (torch.bfloat16, 1, 1), (torch.bfloat16, 3, 2)])
def test_batched_matches_reference_across_dtypes_and_gqa(precision, decode, dtype, gqa,
                                                         heads_per_group):
    """Every row format x decode/extend x GQA 1/3 x float32/bfloat16 against the reference.

    float32: outputs and the whole storage state as compare_with_reference checks them.
    bfloat16: both paths round to bfloat16 at different points (the reference: dequantized
    rows and its SDPA output; extend: each segment's output before the merge; decode: only the
    output, float32 throughout), so outputs agree to about one bfloat16 step (2^-8 relative) of
    the largest output (random low tiers reach |v| ~ 37), and the state is not compared
    (sealing scores from slightly different log-sum-exps may pick another of two near-tied
    tokens)."""
    rng = random.Random(300 + gqa)
    specs = random_specs(rng, 4, decode)
    shape = Shape(gqa=gqa)
    stores = [random_storage(random.Random(7), "cpu", layers=2, heads_per_group=heads_per_group,
                             num_stages=64, dtype=dtype, shape=shape, precision=precision)
              for _ in range(2)]
    plans = random_plans(stores[0], specs, random.Random(8), gap=1, twins=stores[1:])
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(9), "cpu", dtype=dtype, shape=shape)
    outs = []
    for impl in BatchedTorchAttention(stores[0]), TorchAttention(stores[1]):
        outs.append(impl.forward(1, impl.prepare(BatchPlan(requests=list(plans))), q, k, v,
                                 shape.head_dim**-0.5, decode))
    rows = torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in plans])
    if dtype == torch.float32:
        torch.testing.assert_close(outs[0][rows], outs[1][rows], atol=2e-5, rtol=1e-4)
        assert_same_state(*stores)
    else:
        got, want = outs[0][rows].float(), outs[1][rows].float()
        torch.testing.assert_close(got, want, atol=2**-7 * want.abs().max().item(), rtol=2e-2)


# ---- a quantized high tier (--ragged-precision H+L) -----------------------------------------

HIGH_PAIRS = ["int8+int8", "int8+int4", "int8+int2", "int8+fp8", "fp8+int4", "fp8+int2", "fp8+fp8"]
"""Every valid H+L pair (fp8+int8 is refused: its high tier would cost less than its low)."""


@pytest.mark.parametrize("precision", HIGH_PAIRS)
@pytest.mark.parametrize("decode", [False, True])
def test_batched_reads_a_quantized_high_tier(precision, decode):
    """The hi slots in int8 / fp8 read on their codes (decode) or dequantized once (extend),
    as the low tier is: outputs, rows (both tiers sealed by the same quantizer), staging,
    statistics and counters equal the reference's."""
    for seed in range(3):
        rng = random.Random(400 + seed)
        specs = random_specs(rng, rng.randint(1, 5), decode)
        compare_with_reference(BatchedTorchAttention, specs, decode, 400 + seed, "cpu",
                               layer=seed % 2, gap=seed % 2, precision=precision)


@pytest.mark.parametrize("precision", ["int8+int4", "fp8+int2"])
@pytest.mark.parametrize("specs,decode", [
    ([Spec(sealed=0, staged=0, q_len=1), Spec(sealed=3, staged=5, q_len=1)], True),
    ([Spec(sealed=3, staged=0, q_len=1), Spec(0, 2 * P - 1, 1, seal=1)], True),  # seals a page
    ([Spec(sealed=0, staged=0, q_len=3 * P, seal=3), Spec(5, P, 1)], False),  # mixed batch
    ([Spec(sealed=2, staged=3, q_len=2 * P + 1, seal=1), Spec(1, 0, P - 3)], False),
])
def test_batched_high_tier_ragged_tails(precision, specs, decode):
    """Requests of different sealed lengths (padded), partial tail pages and sealing in the
    same forward."""
    compare_with_reference(BatchedTorchAttention, specs, decode, 11, "cpu", layer=1, gap=2,
                           precision=precision)


GARBAGE = 1e3
"""What unread pages hold in the poisoned test: large and finite. Padded sealed slots read
page 0, which the server never writes (zeros), so this path masks padding (-inf logits, zero
probabilities) without guarding against non-finite values there (0 * NaN is NaN); large
values would dominate any row that saw them."""


def _poison_unread(st, plans) -> None:
    """GARBAGE in every sealed page no plan reads (page 0, the padding page, included): its
    full-precision rows and both tiers' parameters; and in every staging page no plan holds
    (the scratch page included)."""
    used = torch.zeros(st.num_pages, dtype=torch.bool)
    held = torch.zeros(st.num_staging_pages + 1, dtype=torch.bool)
    for p in plans:
        used[p.sealed_pages] = True
        held[p.prior_stages] = True
    for layer in range(st.layout.num_layers):
        tiers = [t for t in (*st.low_rows[layer], *st.high_rows[layer]) if t is not None]
        for t in (*st.rows_k[layer], *st.rows_v[layer],
                  *(x for tier in tiers for x in (tier.k_scale, tier.k_zero, tier.v_scale, tier.v_zero)
                    if x is not None)):
            t[~used] = GARBAGE
        st.stage_k[layer][~held] = GARBAGE
        st.stage_v[layer][~held] = GARBAGE


@pytest.mark.parametrize("precision", ["bf16", "int4", "int8+int4", "fp8+int2"])
@pytest.mark.parametrize("decode", [False, True])
def test_poisoned_padding_does_not_leak(precision, decode):
    """Garbage in every page, tier parameter and staging page the batch does not read
    (padded sealed slots read page 0) and NaN in the q/k/v rows it does not own: the owned
    rows' outputs stay finite and equal the reference's (run on the unpoisoned twin)."""
    stores = [random_storage(random.Random(21), "cpu", layers=2, num_stages=64, precision=precision)
              for _ in range(2)]
    specs = [Spec(0, 3, 1), Spec(3, 5, 1 if decode else 2 * P, seal=0 if decode else 1),
             Spec(1, 0, 1 if decode else 5)]
    plans = random_plans(stores[0], specs, random.Random(22), gap=2, twins=stores[1:])
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(23), "cpu")
    _poison_unread(stores[0], plans)
    owned = torch.zeros(q.shape[0], dtype=torch.bool)
    for p in plans:
        owned[p.q_start : p.q_start + p.q_len] = True
    outs = []
    poisoned = [x.masked_fill(~owned[:, None, None], float("nan")) for x in (q, k, v)]
    for impl, (qq, kk, vv) in ((BatchedTorchAttention(stores[0]), poisoned),
                               (TorchAttention(stores[1]), (q, k, v))):
        outs.append(impl.forward(1, impl.prepare(BatchPlan(requests=list(plans))), qq, kk, vv,
                                 P**-0.5, decode))
    rows = owned.nonzero().flatten()
    assert torch.isfinite(outs[0][rows]).all()
    torch.testing.assert_close(outs[0][rows], outs[1][rows], atol=2e-5, rtol=1e-4)
