"""Native CPU attention (cuda_ext/, attention_backend/native_impl.py) against the torch reference.

Fresh random storages and batches (decode, prefill chunks, mixed; ragged tails, random
per-group budgets) for every row precision, head_dim 16/64/80/96/128/256, GQA 1/2/3/4/8, float32 and
bfloat16: outputs, log-sum-exps and (float32) the storage after the forward agree with the
reference's. The extension must build here: every test fails, none skips, if it does not.
H+L pairs (a quantized high tier) and groups of one layer in different formats (mixed at the
binding: each group's tensors and formats from a storage of its own precision) likewise.
Tolerances: float32 atol 1e-4 / rtol 1e-4 (kernel_cases' 2e-5 at head_dim 16; int8 rows hold
values up to ~40, and sums over 128 channels in another order differ by a few 1e-5);
bfloat16 storages against the reference on a float32 twin with the same values: atol 1e-2 /
rtol 1e-2 (the output's rounding to bfloat16; the kernels compute in float32 after loading).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from sgl_ragged import native
from sgl_ragged.attention_backend import native_impl
from sgl_ragged.attention_backend import tail_batch as tail_batch_module
from sgl_ragged.attention_backend.native_impl import TILE_ISAS, NativeAttention
from sgl_ragged.attention_backend.ops import intra_op_threads
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.attention_backend.planner import plan_batch, take_staging
from sgl_ragged.attention_backend.tail_batch import tail_batch, tail_pages, window_stats
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.precision import PAIR_CHOICES
from sgl_ragged.scoring import SnapKVScorer
from tests.unit.kernel_cases import (
    Shape,
    Spec,
    assert_same_state,
    batch_rows,
    compare_with_reference,
    random_plans,
    random_qkv,
    random_specs,
    random_storage,
    reference_lse,
    storage_state,
)

PRECISIONS = ["bf16", "int8", "int4", "int2", "fp8"]
PAIRS = list(PAIR_CHOICES)  # H+L: a quantized high tier (int8 or fp8) over a low tier
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}
REPO = Path(__file__).resolve().parents[2]


def test_the_extension_builds():
    """No silent skip: the kernels build on the test machine (the log path says why if not)."""
    module = native.load()
    assert native.available() and native.reason() is None
    assert module.isa() in ("amx", "avx512", "avx2", "scalar")


def native_only(storage: RaggedStorage) -> NativeAttention:
    """Every forward through the kernels (prefill chunks included)."""
    return NativeAttention(storage, extend_on_batched=False)


def twin_forward(specs: Sequence[Spec], decode: bool, seed: int, shape: Shape, dtype: torch.dtype,
                 precision: str, layer: int = 1, gap: int = 1, poison: bool = False,
                 serial_pairs: int = 0, heads_per_group: int = 2,
                 edit: Callable[[RaggedStorage], None] | None = None,
                 ) -> tuple[RaggedStorage, RaggedStorage, list[RequestPlan], list[torch.Tensor], float]:
    """One forward through NativeAttention (storage and q/k/v in `dtype`) and the reference on
    a float32 twin holding the same values (a bfloat16 reference rounds dequantized rows and
    large logits to bfloat16: its own error, not the kernels'). serial_pairs 0: every layer on
    the thread pool with its key ranges split (NativeAttention's default runs these small
    batches on one thread, unsplit). Returns the storages, plans, both outputs and the largest
    |value| the batch's rows attend to (value_bound). edit: applied to the random storage
    before its twin is made."""
    mine = random_storage(random.Random(seed), "cpu", layers=2, num_stages=64, dtype=dtype,
                          shape=shape, precision=precision, heads_per_group=heads_per_group)
    if edit is not None:
        edit(mine)
    stores = [mine, float32_twin(mine)]
    plans = random_plans(stores[0], specs, random.Random(seed + 1), gap=gap, twins=stores[1:])
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), "cpu", dtype, shape)
    if poison:
        for st in stores:
            poison_unused(st, plans)
        for x in (q, k, v):
            x[~batch_rows(plans, x.shape[0])] = float("nan")
    bound = value_bound(stores[1], layer, plans, v)
    outs = []
    mine = NativeAttention(stores[0], serial_pairs=serial_pairs, extend_on_batched=False)
    for impl, cast in (mine, dtype), (TorchAttention(stores[1]), torch.float32):
        batch = impl.prepare(BatchPlan(requests=list(plans)))
        outs.append(impl.forward(layer, batch, q.to(cast), k.to(cast), v.to(cast),
                                 1 / math.sqrt(shape.head_dim), decode))
    return stores[0], stores[1], plans, outs, bound


def quantized_twin_forward(specs: Sequence[Spec], decode: bool, seed: int, shape: Shape,
                           precision: str, heads_per_group: int,
                           edit: Callable[[RaggedStorage], None] | None = None):
    """twin_forward of a bfloat16 storage on its first layer (1, then 0) whose random budgets
    leave a quantized tier; returns twin_forward's results and that layer."""
    for layer in (1, 0):
        mine, twin, plans, outs, bound = twin_forward(specs, decode, seed, shape, torch.bfloat16,
                                                      precision, layer=layer,
                                                      heads_per_group=heads_per_group, edit=edit)
        if any(t.lo or (t.hi and mine.layout.high is not None) for t in mine.layout.tiers[layer]):
            return mine, twin, plans, outs, bound, layer
    pytest.fail("no layer of the random storage has a quantized tier: pick another seed")


def value_bound(st: RaggedStorage, layer: int, plans: Sequence[RequestPlan],
                v: torch.Tensor) -> float:
    """The largest |value| any row of the batch attends to: sealed rows (low tiers
    dequantized), staged tokens and this forward's."""
    seen = [v[rows_of(plans)].float().abs().max()]
    for p in plans:
        staged = p.prefix - p.tail_start
        if staged:
            seen.append(st.staged_kv(layer, p.prior_stages)[1][:staged].float().abs().max())
        if p.sealed_pages.numel():
            seen += [st.sealed_kv(layer, g, p.sealed_pages)[1].float().abs().max()
                     for g in range(len(st.head_index[layer]))]
    return float(max(seen))


def assert_lse_matches(mine: RaggedStorage, twin: RaggedStorage, plans: Sequence[RequestPlan],
                       layer: int, shape: Shape, seed: int, atol: float, rtol: float) -> None:
    """The native kernels' float32 log-sum-exps of `layer` (the bfloat16 q, k, v twin_forward
    drew from `seed`) against the reference on the float32 twin."""
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), "cpu", torch.bfloat16, shape)
    impl = NativeAttention(mine, extend_on_batched=False)
    batch = impl.prepare(BatchPlan(requests=list(plans)))
    k_pages, v_pages = tail_pages(mine, layer, batch.tails, k, v)
    scale = shape.head_dim**-0.5
    _, lse = impl.module.attend(q, k_pages, v_pages, mine.rows_k[layer], mine.rows_v[layer],
                                impl.low[layer], impl.high[layer], impl.formats[layer],
                                impl.head_map[layer], batch.requests, batch.sealed_off,
                                batch.sealed_pages, scale, 0)
    for p in plans:
        at = slice(p.q_start, p.q_start + p.q_len)
        want = reference_lse(twin, layer, p, q[at].float(), k[at].float(), scale)
        torch.testing.assert_close(lse[at], want, atol=atol, rtol=rtol)


def bf16_tol(bound: float, decode: bool) -> dict[str, float]:
    """Tolerance of a bfloat16 storage's outputs against the float32 twin: TOL's, and for
    prefill chunks on bfloat16 products (module.isa() in TILE_ISAS: AMX tiles or vdpbf16ps) 2^-7
    of the largest |value| more: there the probabilities and dequantized values are rounded to bfloat16 before P V (each
    at most 2^-8 relative, so the output moves by at most ~2^-7 sum_t p_t |v_t| / sum_t p_t
    <= 2^-7 max |v|: the rounding error of a bfloat16 output at the values' scale; logits
    stay float32-exact, quantized keys split into two bfloat16 parts, attention_body.inc)."""
    tol = dict(TOL[torch.bfloat16])
    if not decode and native.load().isa() in TILE_ISAS:
        tol["atol"] += 2**-7 * bound
    return tol


def float32_twin(st: RaggedStorage) -> RaggedStorage:
    """A float32 storage of the same layout holding the same values (rows, tiers, staging)."""
    twin = RaggedStorage(st.layout, st.num_pages, st.num_staging_pages, torch.float32, "cpu",
                         SnapKVScorer())
    for a, b in zip(storage_state(st), storage_state(twin), strict=True):
        b.copy_(a)
    return twin


def poison_unused(st: RaggedStorage, plans: Sequence[RequestPlan]) -> None:
    """NaN in every row, low-tier parameter and staging page no plan reads (padding included:
    page 0 and the scratch staging page)."""
    used = torch.zeros(st.num_pages, dtype=torch.bool)
    for p in plans:
        used[p.sealed_pages] = True
    held = torch.zeros(st.num_staging_pages + 1, dtype=torch.bool)
    for p in plans:
        held[p.prior_stages] = True
    for layer in range(st.layout.num_layers):
        for rows in (st.rows_k[layer], st.rows_v[layer]):
            for t in rows:
                t[~used] = float("nan")
        for tier in (*st.low_rows[layer], *st.high_rows[layer]):
            if tier is None:
                continue
            for t in (tier.k_scale, tier.k_zero, tier.v_scale, tier.v_zero):
                if t is not None:
                    t[~used] = float("nan")
        st.stage_k[layer][~held] = float("nan")
        st.stage_v[layer][~held] = float("nan")


def rows_of(plans: Sequence[RequestPlan]) -> torch.Tensor:
    return torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in plans])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("decode", [True, False])
def test_matches_reference_small_shapes(precision, decode):
    """kernel_cases' own comparison (head_dim 16, GQA 2, page 8): outputs and storage state."""
    for seed in range(4):
        rng = random.Random(200 + seed)
        specs = random_specs(rng, rng.randint(1, 6), decode)
        compare_with_reference(native_only, specs, decode, 200 + seed, "cpu",
                               layer=seed % 2, gap=seed % 3, precision=precision)


@pytest.mark.parametrize("serial_pairs", [0, 2**30], ids=["split", "serial"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("head_dim,gqa", [(64, 1), (64, 3), (80, 4), (96, 3), (128, 4), (128, 8),
                                         (64, 16), (256, 2)])
def test_matches_reference_float32(precision, head_dim, gqa, serial_pairs):
    """Serving head sizes and GQA ratios, a mixed batch (decode requests beside prefill
    chunks, ragged tails): outputs, the window's log-sum-exps and the storage after."""
    shape = Shape(page_size=16, head_dim=head_dim, kv_heads=4, gqa=gqa)
    rng = random.Random(PRECISIONS.index(precision) * 1000 + head_dim * 10 + gqa)
    specs = (random_specs(rng, 3, False, page=16, max_sealed=4)
             + random_specs(rng, 2, True, page=16, max_sealed=4))
    rng.shuffle(specs)
    got, want, plans, outs, _ = twin_forward(specs, False, rng.randrange(999), shape, torch.float32,
                                          precision, serial_pairs=serial_pairs)
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows], outs[1][rows], **TOL[torch.float32])
    assert_same_state(got, want)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("head_dim,gqa", [(64, 1), (64, 3), (128, 4), (128, 8)])
def test_high_tier_pairs_match_reference(pair, head_dim, gqa):
    """--ragged-precision H+L (rows_k/v without slots, the hi slots quantized in high_rows):
    a mixed batch with ragged tails, outputs and storage after, against the reference."""
    shape = Shape(page_size=16, head_dim=head_dim, kv_heads=4, gqa=gqa)
    rng = random.Random(PAIRS.index(pair) * 1000 + head_dim * 10 + gqa)
    specs = (random_specs(rng, 3, False, page=16, max_sealed=4)
             + random_specs(rng, 2, True, page=16, max_sealed=4))
    rng.shuffle(specs)
    got, want, plans, outs, _ = twin_forward(specs, False, rng.randrange(999), shape, torch.float32,
                                          pair)
    assert got.layout.high is not None and any(t is not None for t in got.high_rows[1])
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows], outs[1][rows], **TOL[torch.float32])
    assert_same_state(got, want)


@pytest.mark.parametrize("formats", [("int8+int4", "int2"), ("fp8", "int8+int2"),
                                     ("int4", "fp8+fp8"), ("bf16", "int8+int8")])
@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (128, 4)])
def test_groups_in_different_formats(formats, head_dim, gqa):
    """Each group its own formats: group 0's tensors and formats from a storage of the first
    precision, group 1's from a storage of the second (same budgets, same staging pages); each
    KV head's output equals the reference's on its own storage (heads attend independently)."""
    shape = Shape(page_size=16, head_dim=head_dim, kv_heads=4, gqa=gqa)
    stores = [random_storage(random.Random(41), "cpu", layers=2, num_stages=64, shape=shape,
                             precision=prec) for prec in formats]
    for a, b in zip(stores[0].stage_k + stores[0].stage_v, stores[1].stage_k + stores[1].stage_v,
                    strict=True):
        b.copy_(a)  # the same staging pages (tail tokens)
    assert [len(h) for h in stores[0].head_index[1]] == [2, 2]
    specs = (random_specs(random.Random(42), 3, False, page=16, max_sealed=4)
             + random_specs(random.Random(43), 2, True, page=16, max_sealed=4))
    plans = random_plans(stores[0], specs, random.Random(44), gap=1, twins=stores[1:])
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(45), "cpu", shape=shape)
    scale = 1 / math.sqrt(head_dim)
    want = []
    for st in stores:
        ref = TorchAttention(st)
        want.append(ref.forward(1, ref.prepare(BatchPlan(requests=list(plans))), q, k, v, scale,
                                False))
    impls = [NativeAttention(st, extend_on_batched=False) for st in stores]
    batch = impls[0].prepare(BatchPlan(requests=list(plans)))
    k_pages, v_pages = tail_pages(stores[0], 1, batch.tails, k, v)

    def per_group(name: str, width: int) -> list:
        return [x for g in range(2) for x in getattr(impls[g], name)[1][width * g:width * (g + 1)]]

    out, _ = impls[0].module.attend(
        q, k_pages, v_pages, [stores[g].rows_k[1][g] for g in range(2)],
        [stores[g].rows_v[1][g] for g in range(2)], per_group("low", 6), per_group("high", 6),
        torch.stack([impls[g].formats[1][g] for g in range(2)]), impls[0].head_map[1],
        batch.requests, batch.sealed_off, batch.sealed_pages, scale, 0)
    rows = rows_of(plans)
    for g, heads in enumerate(stores[0].head_index[1]):
        for h in heads.tolist():
            qh = slice(h * gqa, (h + 1) * gqa)
            torch.testing.assert_close(out[rows, qh], want[g][rows, qh], **TOL[torch.float32],
                                       msg=lambda m, g=g: f"group {g} ({formats[g]}): {m}")


def test_bad_formats_are_refused_by_name():
    shape = Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3)
    st = random_storage(random.Random(3), "cpu", layers=2, num_stages=64, shape=shape,
                        precision="int8+int4")
    plans = random_plans(st, random_specs(random.Random(4), 2, True, page=16), random.Random(5))
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(6), "cpu", shape=shape)
    impl = NativeAttention(st, extend_on_batched=False)
    batch = impl.prepare(BatchPlan(requests=list(plans)))
    k_pages, v_pages = tail_pages(st, 1, batch.tails, k, v)

    def attend(formats: torch.Tensor) -> None:
        impl.module.attend(q, k_pages, v_pages, st.rows_k[1], st.rows_v[1], impl.low[1],
                           impl.high[1], formats, impl.head_map[1], batch.requests,
                           batch.sealed_off, batch.sealed_pages, 0.125, 0)

    bad = impl.formats[1].clone()
    bad[0, 2] = 3
    with pytest.raises(RuntimeError, match="group 0 high tier bits must be 0, 2, 4 or 8, got 3"):
        attend(bad)
    bad = impl.formats[1].clone()
    bad[1, 2] = 4  # int4 high tier over int8 codes: the code shapes do not match
    with pytest.raises(RuntimeError, match=r"group 1 high tier code shapes .* are not \[pages"):
        attend(bad)
    with pytest.raises(RuntimeError, match=r"formats \[1, 4\] is not \[2, 4\]"):
        attend(impl.formats[1][:1])


@pytest.mark.parametrize("precision", [*PRECISIONS, "int8+int4", "fp8+int2"])
@pytest.mark.parametrize("decode", [True, False])
def test_matches_reference_bfloat16(precision, decode):
    shape = Shape(page_size=16, head_dim=64, kv_heads=2, gqa=3)
    rng = random.Random(7 + decode)
    specs = random_specs(rng, 4, decode, page=16, max_sealed=4)
    _, _, plans, outs, bound = twin_forward(specs, decode, 31, shape, torch.bfloat16, precision)
    rows = rows_of(plans)
    assert outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, decode))


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("gqa", [1, 2, 3, 5, 6, 7, 8])
def test_dense_bfloat16_keys_of_decode_rows(head_dim, gqa):
    """Decode rows of a bfloat16 storage: on AVX-512 the dense keys' logits (sealed hi slots,
    tail pages) are vdpbf16ps products of the query as stored and the key (attention_body.inc,
    bf16_logit_rows: rows in blocks of 4, then a block of 3, 2 or 1; head sizes 64 and 128),
    the softmax scale applied after, and the values are accumulated from where they are stored
    (accumulate_rows over ValueRows segments, one a page of the unit). Each product of two
    bfloat16 numbers is exact in float32, so the logits differ from the float32 twin's only in summation order and the one rounding
    of the scale: the float32 lse within 2e-5 + 1e-5 |lse| (the float loops' bound) and the
    outputs within bf16_tol. Random pages of 16 and 64 tokens, several per unit."""
    for page in (16, 64):
        shape = Shape(page_size=page, head_dim=head_dim, kv_heads=2, gqa=gqa)
        specs = random_specs(random.Random(gqa * 10 + page), 4, True, page=page, max_sealed=4)
        mine, twin, plans, outs, bound = twin_forward(specs, True, 50 + gqa, shape, torch.bfloat16,
                                                      "bf16")
        rows = rows_of(plans)
        torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, True))
        assert_lse_matches(mine, twin, plans, 1, shape, 50 + gqa, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("precision", ["int8", "int4", "int2", "int8+int4", "int8+int2"])
@pytest.mark.parametrize("head_dim,page,heads,per_group", [
    (64, 16, 2, 2), (80, 16, 2, 2), (96, 16, 2, 2), (128, 16, 2, 2), (192, 16, 2, 2), (256, 16, 2, 2),
    (64, 64, 3, 3),
    (64, 64, 3, 1), (128, 64, 2, 1)])
def test_integer_tiers_of_bfloat16_storages(precision, head_dim, page, heads, per_group, decode):
    """Integer tiers of a bfloat16 storage: on AVX-512 and AVX2 the key codes are dotted as
    integers (VNNI, or vpmaddwd on AVX2 at head sizes 64-256, 192 included: attention_body.inc,
    q' rounded to 16-bit integers per row; decode rounds p' too, and
    prefill chunks on the products take the keys' logits from an integer product of the codes,
    int_tier_logits; head sizes 64, 128 and 256 in every layout of the codes, 192 on the float
    loops or the dequantized keys). Outputs within bf16_tol of the float32 twin's reference; the
    float32 lse within 1e-3 + 1e-4 |lse|: the rounding moves a logit by at most 2^-16 max|q'|
    sum_c code_c (here up to 3e-5 of |lse| ~ 46, against 1e-5 absolute on the float loops), far
    below the error of the bfloat16 query's own rounding (2^-9 relative). (64, 64, 3, 3) is the
    server's (SmolLM2: 64-token pages, the 3 KV heads of a uniform profile in one group; other
    scratch offsets), and with one KV head a group, as per-head precision (`mixed`) serves it:
    each page's value scales then lie contiguous and are read in whole vectors, the page's last
    slots apart."""
    shape = Shape(page_size=page, head_dim=head_dim, kv_heads=heads, gqa=3)
    specs = random_specs(random.Random(head_dim), 4, decode, page=page, max_sealed=4)
    mine, twin, plans, outs, bound, layer = quantized_twin_forward(specs, decode, 41, shape,
                                                                   precision, per_group)
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, decode))
    assert_lse_matches(mine, twin, plans, layer, shape, 41, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "int4", "int8+int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [8, 16])
def test_decode_blocks_of_many_query_heads(precision, head_dim, gqa):
    """Decode rows of a bfloat16 storage at 8 and 16 query heads per KV head (a block of G rows
    at one position): on AVX2 key by key below kDecodeColumnRows = 16 rows and on key columns
    from it, dense keys and integer codes alike (attention_body.inc `on_columns`; blocks of
    several positions take columns from 8 rows). Outputs within bf16_tol of the float32 twin's
    reference, and the float32 lse as test_integer_tiers_of_bfloat16_storages bounds it."""
    shape = Shape(page_size=64, head_dim=head_dim, kv_heads=2, gqa=gqa)
    specs = random_specs(random.Random(gqa * 7 + head_dim), 4, True, page=64, max_sealed=4)
    if precision == "bf16":
        layer = 1
        mine, twin, plans, outs, bound = twin_forward(specs, True, 47, shape, torch.bfloat16,
                                                      precision, layer=layer)
    else:
        mine, twin, plans, outs, bound, layer = quantized_twin_forward(specs, True, 47, shape,
                                                                       precision, 1)
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, True))
    assert_lse_matches(mine, twin, plans, layer, shape, 47, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("precision", ["int4", "int8+int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_integer_tiers_whose_values_are_their_zero_points(precision, head_dim, decode):
    """Quantized slots whose value scales are all 0 (what the quantizer stores for a token whose
    channels are equal: every value is its zero point): the codes get no weight, so the
    integer value products see an all-zero row of weights, but the output still holds the zero
    points' share (int_values adds it with or without weight on the codes)."""
    def zero_value_scales(st: RaggedStorage) -> None:
        for layer in range(st.layout.num_layers):
            for tier in (*st.low_rows[layer], *st.high_rows[layer]):
                if tier is not None:
                    tier.v_scale.zero_()

    shape = Shape(page_size=64, head_dim=head_dim, kv_heads=3, gqa=3)
    specs = random_specs(random.Random(head_dim + 7), 4, decode, page=64, max_sealed=4)
    _, _, plans, outs, bound, _ = quantized_twin_forward(specs, decode, 43, shape, precision, 3,
                                                         edit=zero_value_scales)
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, decode))


@pytest.mark.parametrize("precision", ["bf16", "int4"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_prefill_chunks_on_serving_pages(precision, head_dim):
    """Pages of 64 tokens (the server's), prefill chunks of up to three pages: a causal row's
    key limit ends inside or before a 16-lane vector of its page's logits (masks for rows
    whose limit lies behind the vector; 16-token pages never reach that case)."""
    shape = Shape(page_size=64, head_dim=head_dim, kv_heads=4, gqa=3)
    specs = random_specs(random.Random(17), 3, False, page=64, max_sealed=3)
    specs.append(Spec(sealed=2, staged=0, q_len=192, seal=2))
    for dtype in (torch.float32, torch.bfloat16):
        _, _, plans, outs, bound = twin_forward(specs, False, 18, shape, dtype, precision)
        rows = rows_of(plans)
        tol = bf16_tol(bound, False) if dtype == torch.bfloat16 else TOL[dtype]
        torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **tol)


@pytest.mark.parametrize("precision", [*PRECISIONS, "int8+int4"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_prefill_chunks_on_amx_tiles(precision, head_dim, gqa):
    """bfloat16 prefill chunks on the server's 64-token pages: the avx512 and amx variants run
    them as bfloat16 matrix products (attention_body.inc, RAGGED_TILES: vdpbf16ps, or AMX tiles
    on an AMX CPU); outputs within bf16_tol of the float32 twin's reference (a decode request
    rides along on the loops)."""
    module = native.load()
    if native.cpu_has_amx():
        assert module.isa() == "amx", "an AMX CPU must run prefill chunks on the tiles"
    shape = Shape(page_size=64, head_dim=head_dim, kv_heads=2, gqa=gqa)
    specs = random_specs(random.Random(gqa), 2, False, page=64, max_sealed=3)
    specs += [Spec(sealed=2, staged=0, q_len=130, seal=2), Spec(sealed=1, staged=40, q_len=1)]
    mine, twin, plans, outs, bound = twin_forward(specs, False, 19 + head_dim, shape,
                                                  torch.bfloat16, precision, layer=0)
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, False))


@pytest.mark.parametrize("precision", ["bf16", "int4"])
@pytest.mark.parametrize("poison", [False, True])
def test_long_chunks_take_several_tail_pages_a_unit(precision, poison):
    """bfloat16 chunks of 10 and 6 tail pages: the tiles attend up to unit_keys / P (4 of 64
    tokens) consecutive tail pages a unit, with causal limits across their boundaries, a short
    last unit, query blocks of 75 positions and every item's key range split over the pool
    (serial_pairs 0), so units start mid-tail; NaN past what the batch owns stays out."""
    shape = Shape(page_size=64, head_dim=64, kv_heads=2, gqa=3)
    specs = [Spec(sealed=2, staged=20, q_len=600, seal=8), Spec(sealed=0, staged=0, q_len=333, seal=4)]
    _, _, plans, outs, bound = twin_forward(specs, False, 31, shape, torch.bfloat16, precision,
                                            gap=2 if poison else 1, poison=poison)
    rows = rows_of(plans)
    assert torch.isfinite(outs[0][rows]).all()
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, False))


@pytest.mark.parametrize("precision", ["bf16", "int4", "int2"])
@pytest.mark.parametrize("head_dim", [16, 48])
def test_amx_tiles_at_head_dims_below_a_tile_row(precision, head_dim):
    """head_dim 16 and 48: a key's channel pairs fill part of a 16-word transpose block
    (pack_keys' masked loads), int4/int2 codes not whole 16-byte runs (decode_codes)."""
    shape = Shape(page_size=64, head_dim=head_dim, kv_heads=2, gqa=3)
    specs = [Spec(sealed=3, staged=5, q_len=100, seal=1), Spec(sealed=1, staged=0, q_len=7)]
    _, _, plans, outs, bound = twin_forward(specs, False, 23, shape, torch.bfloat16, precision)
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, False))


@pytest.mark.parametrize("precision", ["bf16", "int4", "fp8+int2"])
def test_poisoned_padding_stays_off_the_tiles(precision):
    """NaN everywhere the batch does not own (test_poisoned_padding_does_not_leak) with bfloat16
    prefill chunks on 64-token pages: key columns and value rows past what a row sees are
    zeros on the tiles (a NaN times a zero probability would be NaN)."""
    shape = Shape(page_size=64, head_dim=64, kv_heads=2, gqa=3)
    specs = [Spec(sealed=2, staged=10, q_len=90, seal=1), Spec(sealed=3, staged=0, q_len=40)]
    _, _, plans, outs, bound = twin_forward(specs, False, 29, shape, torch.bfloat16, precision,
                                            gap=2, poison=True)
    rows = rows_of(plans)
    assert torch.isfinite(outs[0][rows]).all()
    torch.testing.assert_close(outs[0][rows].float(), outs[1][rows], **bf16_tol(bound, False))


@pytest.mark.parametrize("precision", ["bf16", "int4", "int8+int4"])
def test_log_sum_exp_on_amx_tiles(precision):
    """The log-sum-exp sealing reads, of bfloat16 prefill chunks on 64-token pages. On the AMX
    and AVX512-BF16 products (TILE_ISAS) logits stay float32 (bfloat16 q and keys multiply
    exactly, quantized keys split in two parts), so within 1e-4 of the reference's on a float32
    twin; elsewhere (the avx2 and scalar loops) within 1e-3 + 1e-4 |lse|."""
    shape = Shape(page_size=64, head_dim=64, kv_heads=2, gqa=3)
    st = random_storage(random.Random(8), "cpu", layers=2, num_stages=64, dtype=torch.bfloat16,
                        shape=shape, precision=precision)
    specs = [Spec(sealed=2, staged=0, q_len=130, seal=2), Spec(sealed=3, staged=20, q_len=70)]
    plans = random_plans(st, specs, random.Random(9), gap=2)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(10), "cpu", torch.bfloat16, shape)
    twin = float32_twin(st)  # the reference dequantizes in float32 there
    impl = NativeAttention(st, extend_on_batched=False)
    batch = impl.prepare(BatchPlan(requests=list(plans)))
    k_pages, v_pages = tail_pages(st, 1, batch.tails, k, v)
    _, lse = impl.module.attend(q, k_pages, v_pages, st.rows_k[1], st.rows_v[1], impl.low[1],
                                impl.high[1], impl.formats[1], impl.head_map[1], batch.requests,
                                batch.sealed_off, batch.sealed_pages, 0.125, 0)
    on_tiles = impl.module.isa() in TILE_ISAS
    tol = dict(atol=1e-4, rtol=1e-5) if on_tiles or precision == "bf16" else dict(atol=1e-3, rtol=1e-4)
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = reference_lse(twin, 1, p, q[rows].float(), k[rows].float(), 0.125)
        torch.testing.assert_close(lse[rows], want, **tol)


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_running_max_that_jumps_inside_a_unit(precision):
    """Sealed keys that grow page by page (x1.1 a page, x45 over 40 pages, each request's pages
    in its own order): a prefill row's logits rise by more than kMaxSlack within a unit and
    from one unit to the next, so the tiles' one-pass softmax (tile_softmax against the running
    max) gives up midway and takes the two-pass update, while the chunk's unscaled tail keys
    stay below that max and keep the one pass. Outputs within bf16_tol of the float32 twin's
    reference, lse within 1e-4 + 1e-5 |lse| where the logits are float32-exact (else
    test_log_sum_exp_on_amx_tiles' 1e-3 + 1e-4 |lse|); the other variants' loops too."""
    shape = Shape(page_size=64, head_dim=64, kv_heads=2, gqa=3)
    st = random_storage(random.Random(50), "cpu", layers=2, num_pages=96, num_stages=64,
                        dtype=torch.bfloat16, shape=shape, precision=precision)
    layer = next((i for i, tiers in enumerate(st.layout.tiers)
                  if all(t.hi < 64 and (t.lo or precision == "bf16") for t in tiers)), None)
    assert layer is not None, "no layer of the random storage drops or quantizes: another seed"
    specs = [Spec(sealed=40, staged=10, q_len=100), Spec(sealed=25, staged=0, q_len=40)]
    plans = random_plans(st, specs, random.Random(51))
    for p in plans:
        for i, page in enumerate(p.sealed_pages.tolist()):
            grow = 1.1**i
            for rows in st.rows_k[layer]:
                rows[page] *= grow
            for tier in st.low_rows[layer]:
                if tier is not None:
                    tier.k_scale[page] *= grow
                    tier.k_zero[page] *= grow
    twin = float32_twin(st)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(52), "cpu", torch.bfloat16, shape)
    bound = value_bound(twin, layer, plans, v)
    impl = NativeAttention(st, serial_pairs=0, extend_on_batched=False)
    batch = impl.prepare(BatchPlan(requests=list(plans)))
    k_pages, v_pages = tail_pages(st, layer, batch.tails, k, v)
    out, lse = impl.module.attend(q, k_pages, v_pages, st.rows_k[layer], st.rows_v[layer],
                                  impl.low[layer], impl.high[layer], impl.formats[layer],
                                  impl.head_map[layer], batch.requests, batch.sealed_off,
                                  batch.sealed_pages, 0.125, 0)
    ref = TorchAttention(twin)
    want = ref.forward(layer, ref.prepare(BatchPlan(requests=list(plans))), q.float(), k.float(),
                       v.float(), 0.125, False)
    rows = rows_of(plans)
    torch.testing.assert_close(out[rows].float(), want[rows], **bf16_tol(bound, False))
    # float32-exact logits: bfloat16 keys on the tiles, and int4 keys dequantized in two parts
    # on AMX; avx512 dots int4 codes with q' in 16-bit integers, the loops sum in another order
    exact = impl.module.isa() == "amx" or (precision == "bf16" and impl.module.isa() in TILE_ISAS)
    tol = dict(atol=1e-4, rtol=1e-5) if exact else dict(atol=1e-3, rtol=1e-4)
    for p in plans:
        at = slice(p.q_start, p.q_start + p.q_len)
        torch.testing.assert_close(lse[at], reference_lse(twin, layer, p, q[at].float(),
                                                          k[at].float(), 0.125), **tol)


@pytest.mark.parametrize("precision", ["bf16", "int4", "fp8"])
def test_log_sum_exp_of_every_query(precision):
    """The kernel's lse [N, H_q] (which sealing reads for the window) for every owned row."""
    shape = Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3)
    st = random_storage(random.Random(3), "cpu", layers=2, num_stages=64, shape=shape,
                        precision=precision)
    specs = random_specs(random.Random(4), 4, False, page=16, max_sealed=4)
    plans = random_plans(st, specs, random.Random(5), gap=2)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(6), "cpu", shape=shape)
    impl = NativeAttention(st, extend_on_batched=False)
    batch = impl.prepare(BatchPlan(requests=list(plans)))
    k_pages, v_pages = tail_pages(st, 1, batch.tails, k, v)
    _, lse = impl.module.attend(q, k_pages, v_pages, st.rows_k[1], st.rows_v[1], impl.low[1],
                                impl.high[1], impl.formats[1],
                                impl.head_map[1], batch.requests, batch.sealed_off,
                                batch.sealed_pages, 0.125, 0)
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = reference_lse(st, 1, p, q[rows], k[rows], 0.125)
        torch.testing.assert_close(lse[rows], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "int4", "int2", "fp8", "int8+int4", "fp8+fp8"])
@pytest.mark.parametrize("decode", [True, False])
def test_poisoned_padding_does_not_leak(precision, decode):
    """NaN in every page, staging page, low-tier parameter and q/k/v row the batch does not
    own: the owned rows' outputs stay finite and equal the reference's."""
    shape = Shape(page_size=16, head_dim=64, kv_heads=4, gqa=4)
    specs = random_specs(random.Random(11), 4, decode, page=16, max_sealed=4)
    _, _, plans, outs, _ = twin_forward(specs, decode, 12, shape, torch.float32, precision,
                                     gap=2, poison=True)
    rows = rows_of(plans)
    assert torch.isfinite(outs[0][rows]).all()
    torch.testing.assert_close(outs[0][rows], outs[1][rows], **TOL[torch.float32])


@pytest.mark.parametrize("specs,decode", [
    ([Spec(sealed=0, staged=0, q_len=1)], True),  # a lone first token
    ([Spec(sealed=3, staged=0, q_len=1), Spec(0, 15, 1, seal=1)], True),
    ([Spec(sealed=0, staged=0, q_len=48, seal=3), Spec(5, 16, 1)], False),  # mixed batch
    ([Spec(sealed=2, staged=3, q_len=33, seal=1)], False),
    ([Spec(sealed=40, staged=0, q_len=1), Spec(sealed=1, staged=2, q_len=1)], True),  # splits
])
def test_edge_cases(specs, decode):
    shape = Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3)
    got, want, plans, outs, _ = twin_forward(specs, decode, 5, shape, torch.float32, "int4")
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows], outs[1][rows], **TOL[torch.float32])
    assert_same_state(got, want)


ISA_SCRIPT = """
import json, math, random, sys, torch
from sgl_ragged import native
from sgl_ragged.attention_backend.native_impl import NativeAttention
from sgl_ragged.attention_backend.plan import BatchPlan
from tests.unit.kernel_cases import Shape, random_plans, random_qkv, random_specs, random_storage
from tests.unit.test_native_attention import value_bound
torch.set_num_threads(2)
shape = Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3)
outs, bounds = {}, {}
for precision in ("bf16", "int8", "int4", "int2", "fp8", "int8+int4", "fp8+int2"):
    for dtype in (torch.float32, torch.bfloat16):
        st = random_storage(random.Random(1), "cpu", layers=2, num_stages=64, shape=shape,
                            dtype=dtype, precision=precision)
        specs = (random_specs(random.Random(2), 3, False, page=16, max_sealed=4)
                 + random_specs(random.Random(3), 2, True, page=16, max_sealed=4))
        plans = random_plans(st, specs, random.Random(4))
        q, k, v = random_qkv(plans, torch.Generator().manual_seed(5), "cpu", dtype, shape)
        bounds[f"{precision}-{dtype}"] = value_bound(st, 0, plans, v)
        impl = NativeAttention(st, serial_pairs=0 if dtype == torch.float32 else 2**30,
                               extend_on_batched=False)
        out = impl.forward(0, impl.prepare(BatchPlan(requests=plans)), q, k, v, 0.125, False)
        rows = torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in plans])
        outs[f"{precision}-{dtype}"] = out[rows].float().tolist()
print(json.dumps({"isa": native.load().isa(), "outs": outs, "bounds": bounds}))
"""


def run_isa(isa: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("RAGGED_NATIVE_ISA", None)
    if isa:
        env["RAGGED_NATIVE_ISA"] = isa
    done = subprocess.run([sys.executable, "-c", ISA_SCRIPT], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_forced_isa_variants_agree():
    """RAGGED_NATIVE_ISA forces a lower variant: each gives the best one's results (float32
    up to FMA contraction, bfloat16 outputs up to one rounding step, or bf16_tol's where the
    best runs prefill chunks on bfloat16 products and the forced one on float32 loops)."""
    best = run_isa(None)
    lower = {"amx": ["avx512", "avx2", "scalar"], "avx512": ["avx2", "scalar"], "avx2": ["scalar"],
             "scalar": []}[best["isa"]]
    assert lower or best["isa"] == "scalar"
    for isa in lower:
        got = run_isa(isa)
        assert got["isa"] == isa
        for key, want in best["outs"].items():
            tol = dict(TOL[torch.bfloat16] if "bfloat16" in key else TOL[torch.float32])
            if "bfloat16" in key and best["isa"] in TILE_ISAS:  # bf16_tol: P, V rounded
                tol["atol"] += 2**-7 * best["bounds"][key]
            torch.testing.assert_close(torch.tensor(got["outs"][key]), torch.tensor(want),
                                       **tol, msg=lambda m, k=key, i=isa: f"{i} {k}: {m}")


LINEAR_ISA_SCRIPT = ("from sgl_ragged import native\n"
                     "print(native.load().linear_isa())\n")


@pytest.mark.parametrize("script", [ISA_SCRIPT, LINEAR_ISA_SCRIPT], ids=["attention", "linear"])
def test_unknown_isa_is_refused(script: str):
    """By the attention and by linear_bf16 alike: both follow bindings.cpp's one choice."""
    env = {**os.environ, "RAGGED_NATIVE_ISA": "sse9"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode != 0 and "RAGGED_NATIVE_ISA=sse9 is not one this CPU runs" in done.stderr


def test_refuses_other_dtypes_by_name():
    st = random_storage(random.Random(0), "cpu", dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 and bfloat16 caches, not torch.float16"):
        NativeAttention(st)


class SpyModule:
    """The built kernels behind a spy: counts attend and window_stats calls and reports `isa`
    as the variant in use (the routing asks the module which variant runs)."""

    def __init__(self, isa: str | None = None) -> None:
        self.module = native.load()
        self.copy_rows = self.module.copy_rows
        self.variant = isa or self.module.isa()
        self.calls: list[int] = []
        self.stats_calls: list[int] = []

    def attend(self, *args):
        self.calls.append(1)
        return self.module.attend(*args)

    def window_stats(self, *args):
        self.stats_calls.append(1)
        return self.module.window_stats(*args)

    def isa(self) -> str:
        return self.variant


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("amx_cpu", [False, True])
def test_prefill_chunks_routed_by_variant(decode, amx_cpu, monkeypatch):
    """native_impl.prefill_on_batched: on the avx512 variant, prefill chunks run the kernels on
    a CPU without AMX and the batched torch path (with tails.cpp's window statistics) on one
    with AMX; decode batches always run the kernels; both match the reference."""
    monkeypatch.setattr(native, "cpu_has_amx", lambda: amx_cpu)
    monkeypatch.delenv("RAGGED_NATIVE_PREFILL", raising=False)
    spy = SpyModule("avx512")
    specs = random_specs(random.Random(17), 4, decode)
    compare_with_reference(lambda st: NativeAttention(st, module=spy), specs, decode, 17, "cpu",
                           layer=1)
    assert bool(spy.calls) == (decode or not amx_cpu)
    assert spy.stats_calls == [1]


@pytest.mark.parametrize(("isa", "amx_cpu", "dtype", "on_batched"), [
    ("amx", True, torch.bfloat16, False),   # tile products
    ("amx", True, torch.float32, True),
    ("avx512", True, torch.bfloat16, True),  # forced lower on an AMX CPU
    ("avx512", False, torch.bfloat16, False),
    ("avx512", False, torch.float32, False),
    ("avx2", False, torch.bfloat16, False),  # key columns
    ("avx2", False, torch.float32, False),
    ("avx2", True, torch.bfloat16, True),  # forced lower on an AMX CPU
    ("scalar", False, torch.float32, True),
])
@pytest.mark.parametrize("precision", ["int4", "int8+int4"])
def test_prefill_routing_table(isa, amx_cpu, dtype, on_batched, precision, monkeypatch):
    """Which variant sends a storage's prefill chunks to batched torch (prefill_on_batched's
    docstring has the measurements; H+L rows alike: the batched path reads a quantized high
    tier, registry.HIGH_TIER_READERS); extend_on_batched=False keeps every forward native."""
    from sgl_ragged.attention_backend.registry import HIGH_TIER_READERS

    assert "batched" in HIGH_TIER_READERS
    monkeypatch.setattr(native, "cpu_has_amx", lambda: amx_cpu)
    monkeypatch.delenv("RAGGED_NATIVE_PREFILL", raising=False)
    st = random_storage(random.Random(0), "cpu", dtype=dtype, precision=precision)
    assert native_impl.prefill_on_batched(st, SpyModule(isa)) == on_batched
    assert (NativeAttention(st, module=SpyModule(isa)).batched is not None) == on_batched
    assert NativeAttention(st, module=SpyModule(isa), extend_on_batched=False).batched is None


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2"])
def test_prefill_routing_forced_by_the_environment(isa, monkeypatch):
    """RAGGED_NATIVE_PREFILL=native|batched overrides the measured rule on every variant; any
    other value is refused with the choices."""
    st = random_storage(random.Random(0), "cpu", dtype=torch.bfloat16, precision="int4")
    for forced, on_batched in (("native", False), ("batched", True)):
        monkeypatch.setenv("RAGGED_NATIVE_PREFILL", forced)
        assert native_impl.prefill_on_batched(st, SpyModule(isa)) == on_batched
        assert (NativeAttention(st, module=SpyModule(isa)).batched is not None) == on_batched
    monkeypatch.setenv("RAGGED_NATIVE_PREFILL", "tiles")
    with pytest.raises(ValueError, match="RAGGED_NATIVE_PREFILL=tiles is not a choice"):
        NativeAttention(st, module=SpyModule(isa))


def test_amx_variant_where_the_cpu_has_tiles():
    """The built kernels pick the amx variant exactly where the CPU advertises AMX."""
    if os.environ.get("RAGGED_NATIVE_ISA"):
        pytest.skip("RAGGED_NATIVE_ISA forces a variant")
    assert (native.load().isa() == "amx") == native.cpu_has_amx()


def test_build_command_finds_the_cached_build(capsys):
    from sgl_ragged.native.__main__ import main

    native.load()
    assert main(["build"]) == 0
    assert str(native.cache_dir()) in capsys.readouterr().out


def test_a_failed_build_names_its_compiler_log(monkeypatch, tmp_path):
    """What env.sh prints and `auto` logs: the error with the log's path (the compiler's
    output inside)."""
    monkeypatch.setenv("RAGGED_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    assert not native.is_built()
    with pytest.raises(native.NativeUnavailableError, match="compiler log: .*build.log") as e:
        native.build()
    log = Path(str(e.value).split("compiler log: ")[1].rstrip(")"))
    assert log.is_file() and log.parent.parent == tmp_path and "false" in log.read_text()


class FakeCompiler:
    """torch's cpp_extension.load as the build calls it: 'compiles' the sources it is given into
    a file holding their text, and first runs `during` (an edit while the compiler runs)."""

    def __init__(self, during=lambda: None):
        self.during = during

    def __call__(self, name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        self.during()
        so = Path(build_directory) / f"{name}.so"
        so.write_bytes(b"".join(Path(s).read_bytes() for s in sources))
        return type("Module", (), {"__file__": str(so)})


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """A copy of cuda_ext/ as the sources and an empty cache, both under tmp_path."""
    from torch.utils import cpp_extension

    src = tmp_path / "cuda_ext"
    src.mkdir()
    for name in (*native.SOURCES, *native.HEADERS):
        (src / name).write_bytes((native.SOURCE_DIR / name).read_bytes())
    monkeypatch.setattr(native, "SOURCE_DIR", src)
    monkeypatch.setenv("RAGGED_CACHE", str(tmp_path / "cache"))
    compiler = FakeCompiler()
    monkeypatch.setattr(cpp_extension, "load", compiler)
    return src, compiler


def test_an_edit_during_the_build_cannot_stale_the_cache(fake_build):
    """The cache directory is named by the sources that were compiled: an edit made while the
    compiler runs leaves the built directory under the old sources' hash and the new sources
    unbuilt (session 25 once found a native-<hash> holding another revision's .so)."""
    src, compiler = fake_build
    before = native.cache_dir()
    compiled = b"".join((src / n).read_bytes() for n in native.SOURCES)
    compiler.during = lambda: (src / "linear.cpp").write_text("// edited mid-build\n")
    module = native.build()
    assert Path(module.__file__).parent.name.startswith(before.name)  # loaded from staging
    assert (before / "sgl_ragged_native.so").read_bytes() == compiled
    assert (before / native.STAMP).read_text().strip() == "sgl_ragged_native.so"
    assert (before / "src" / "linear.cpp").read_bytes() != (src / "linear.cpp").read_bytes()
    assert native.cache_dir() != before and not native.is_built()
    assert [p.name for p in before.parent.iterdir()] == [before.name]  # no staging left
    # a build killed mid-compile left its staging directory: the next build removes it, and
    # leaves a live process's alone
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    abandoned = before.with_name(f"native-0123456789ab.{dead}.tmp")
    running = before.with_name(f"native-0123456789ab.{os.getppid()}.tmp")
    abandoned.mkdir()
    running.mkdir()
    compiler.during = lambda: None
    native.build()
    assert not abandoned.exists() and running.is_dir()


def test_a_failed_build_is_replaced_and_a_finished_one_kept(fake_build, monkeypatch):
    """A failed build leaves its log where the error says and no stamp; the next build replaces
    it. A build that finds another process's finished build in place keeps that one."""
    src, compiler = fake_build

    def fail():
        raise RuntimeError("g++: fatal error")

    compiler.during = fail
    with pytest.raises(native.NativeUnavailableError, match="compiler log: .*build.log"):
        native.build()
    assert "g++: fatal error" in native.log_path().read_text() and not native.is_built()
    compiler.during = lambda: None
    native.build()
    assert native.is_built() and "fatal" not in native.log_path().read_text()
    out = native.cache_dir()
    (out / "theirs").write_text("kept")  # another process's finished build, and ours:
    staging = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    staging.mkdir()
    (staging / native.STAMP).write_text("sgl_ragged_native.so\n")
    native._move_into_place(staging, out)
    assert (out / "theirs").is_file() and not staging.exists()


# Window statistics shapes: the tests' page, serving pages (P = 64, head_dim 64 / 128, G = 3 / 4:
# whole and split row blocks of the AVX-512 form), a page not in whole 16-key tiles with G = 8
# (row blocks of 3, 3 and 2) and head_dim 48.
WINDOW_SHAPES = [Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3),
                 Shape(page_size=64, head_dim=64, kv_heads=4, gqa=3),
                 Shape(page_size=64, head_dim=128, kv_heads=2, gqa=4),
                 Shape(page_size=24, head_dim=48, kv_heads=2, gqa=8)]


def window_case(seed: int, dtype: torch.dtype, shape: Shape) -> tuple:
    """A random decode + prefill batch's window_stats arguments (storage, tails, k_pages, q,
    lse; windows of 1 to 32 queries, so causal limits at any token of a page); rows of q and
    lse the window does not read hold NaN."""
    P = shape.page_size
    rng = random.Random(seed)
    st = random_storage(rng, "cpu", layers=2, num_stages=64, dtype=dtype, shape=shape)
    specs = (random_specs(rng, 3, False, page=P, max_sealed=2)
             + random_specs(rng, 3, True, page=P, max_sealed=2))
    plans = [dataclasses.replace(p, obs_queries=min(p.q_len, rng.choice([1, 4, 32])))
             for p in random_plans(st, specs, random.Random(seed + 1), gap=1)]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(plans, gen, "cpu", dtype, shape)
    lse = torch.rand(q.shape[0], q.shape[1], generator=gen) * 4 + 2
    tails = tail_batch(plans, P, torch.device("cpu"))
    unread = torch.ones(q.shape[0], dtype=torch.bool)
    unread[tails.page_win_row[tails.page_win_pos >= 0]] = False
    q[unread], lse[unread] = float("nan"), float("nan")
    k_pages, _ = tail_pages(st, 1, tails, k, v)
    return st, tails, k_pages, q, lse


WINDOW_NAMES = ("attn", "q_sum", "q_sq_sum", "q_count")


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_window_stats_match_torch(seed, dtype, shape):
    """cuda_ext/tails.cpp's window statistics equal tail_batch.window_stats' (decode and
    prefill batches, sealing or not, windows of several queries), on the best variant's form
    (AVX-512 where the CPU has it, AVX2 where it has that). Tolerance 1e-5: those forms' exp
    (exp_approx's polynomial, relative error < 2e-7) and their dot products' order move each
    probability by a few 1e-7 relative, attn sums at most 32 of them."""
    st, tails, k_pages, q, lse = window_case(seed, dtype, shape)
    want = window_stats(st, 1, tails, k_pages, q, lse, 0.125)
    got = NativeAttention(st).window_stats(st, 1, tails, k_pages, q, lse, 0.125)
    assert tails.page_win_row.shape[1] > 1
    for name in WINDOW_NAMES:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5,
                                   rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


WINDOW_SCRIPT = """
import json, torch
from sgl_ragged import native
from sgl_ragged.attention_backend.native_impl import NativeAttention
from tests.unit.test_native_attention import WINDOW_NAMES, WINDOW_SHAPES, window_case
torch.set_num_threads(2)
outs = {}
for i, shape in enumerate(WINDOW_SHAPES):
    for dtype in (torch.float32, torch.bfloat16):
        st, tails, k_pages, q, lse = window_case(i, dtype, shape)
        got = NativeAttention(st).window_stats(st, 1, tails, k_pages, q, lse, 0.125)
        outs[f"{shape}-{dtype}"] = {n: getattr(got, n).tolist() for n in WINDOW_NAMES}
print(json.dumps({"isa": native.load().isa(), "outs": outs}))
"""


def window_stats_on(isa: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("RAGGED_NATIVE_ISA", None)
    if isa:
        env["RAGGED_NATIVE_ISA"] = isa
    done = subprocess.run([sys.executable, "-c", WINDOW_SCRIPT], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_window_stats_forms_agree():
    """Each lower form gives the best variant's window statistics within
    test_window_stats_match_torch's tolerance (std::exp against the polynomial of the AVX-512
    and AVX2 forms, dot products in another order): on an AVX-512 CPU the AVX2 form
    (RAGGED_NATIVE_ISA=avx2; head size 48 takes it there unforced) and the portable one
    (scalar), on an AVX2 CPU the portable one."""
    best = window_stats_on(None)
    lower = ("avx2", "scalar") if best["isa"] in ("amx", "avx512") else ("scalar",)
    assert best["isa"] in ("amx", "avx512", "avx2"), f"the best variant here is {best['isa']}"
    for forced in lower:
        got = window_stats_on(forced)
        assert got["isa"] == forced and got["outs"].keys() == best["outs"].keys()
        for key, want in best["outs"].items():
            for name in WINDOW_NAMES:
                torch.testing.assert_close(torch.tensor(got["outs"][key][name]),
                                           torch.tensor(want[name]), atol=1e-5, rtol=1e-5,
                                           msg=lambda m, k=key, n=name, f=forced: f"{f} {k} {n}: {m}")


@pytest.mark.parametrize("shape", [Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3),
                                   Shape(page_size=64, head_dim=64, kv_heads=4, gqa=3)])
@pytest.mark.parametrize("seed", range(3))
def test_decode_in_place_matches_reference(seed, shape, monkeypatch):
    """Decode batches (random staged counts; the new token fills a page or opens one; some
    requests seal their first complete pages) take the in-place tails (stage_fresh: only the
    fresh slots and the padding of pages new to the staging are written): outputs and the
    whole storage equal the reference's."""
    calls = []
    monkeypatch.setattr(native_impl, "stage_fresh",
                        lambda *a: calls.append(1) or tail_batch_module.stage_fresh(*a))
    P = shape.page_size
    rng = random.Random(seed)
    staged = [rng.choice([rng.randrange(2 * P), P - 1, P, 2 * P]) for _ in range(rng.randint(1, 6))]
    specs = [Spec(sealed=rng.randrange(3), staged=n, q_len=1, seal=rng.randint(0, n // P))
             for n in staged]
    got, want, plans, outs, _ = twin_forward(specs, True, seed, shape, torch.float32, "int4")
    rows = rows_of(plans)
    torch.testing.assert_close(outs[0][rows], outs[1][rows], **TOL[torch.float32])
    assert_same_state(got, want)
    assert calls == [1]


def test_copy_rows_writes_only_its_slots_and_refuses_bad_input():
    """tails.cpp's copy_rows (stage_tokens' native copy): dst[slots] = src[rows], zeros where
    a row is negative, other rows as they were; out-of-range slots and rows, dtype and shape
    mismatches refused by name."""
    copy_rows = native.load().copy_rows
    dst = torch.randn(10, 3, 4).bfloat16()
    want = dst.clone()
    slots, rows = torch.tensor([7, 0, 3, 5]), torch.tensor([2, -1, 0, 2])
    src = torch.randn(3, 3, 4).bfloat16()
    want[slots] = torch.cat([torch.zeros(1, 3, 4).bfloat16(), src])[rows + 1]
    copy_rows(dst, slots, src, rows)
    assert torch.equal(dst, want)
    with pytest.raises(RuntimeError, match="slot 10 is outside"):
        copy_rows(dst, torch.tensor([10, 0, 1, 2]), src, rows)
    with pytest.raises(RuntimeError, match="row 3 is outside"):
        copy_rows(dst, slots, src, torch.tensor([3, 0, 0, 0]))
    with pytest.raises(RuntimeError, match="convert it first"):
        copy_rows(dst, slots, src.float(), rows)
    with pytest.raises(RuntimeError, match="rows of dst"):
        copy_rows(dst, slots, torch.randn(3, 3, 5).bfloat16(), rows)



@pytest.mark.parametrize("window", [1, 2])
def test_staging_pages_hold_zeros_past_each_end_over_a_request(window):
    """Two requests driven through the planner (a prefill chunk through store_tails' whole
    pages, then decode steps in place across page boundaries; the first finishes and its
    staging pages go back to the second) with every free staging page full of NaN: after
    every forward, each staged page holds zeros past its request's end in every layer
    (stage_fresh writes only fresh slots of pages held before, so it relies on this), and
    outputs and the storage equal the reference's driven the same way."""
    P, shape = 16, Shape(page_size=16, head_dim=64, kv_heads=4, gqa=3)
    stores = [random_storage(random.Random(5), "cpu", layers=2, num_stages=12, shape=shape,
                             precision="int4") for _ in range(2)]
    for st in stores:
        for t in st.stage_k + st.stage_v:
            t.fill_(float("nan"))
    impls = [NativeAttention(stores[0], extend_on_batched=False), TorchAttention(stores[1])]
    req_to_token = torch.zeros(2, 512, dtype=torch.long)
    free = list(range(1, stores[0].num_pages))
    lens = [0, 0]
    gen = torch.Generator().manual_seed(6)

    def step(news: dict[int, int]) -> None:
        rows = list(news)
        for r in rows:  # pages as SGLang's paged allocator hands them out
            for pos in range(lens[r], lens[r] + news[r]):
                if pos % P == 0:
                    page = free.pop()
                    req_to_token[r, pos:pos + P] = torch.arange(page * P, page * P + P)
        n = sum(news.values())
        q = torch.randn(n, shape.kv_heads * shape.gqa, shape.head_dim, generator=gen)
        k, v = (torch.randn(n, shape.kv_heads, shape.head_dim, generator=gen) for _ in range(2))
        outs = []
        for st, impl in zip(stores, impls, strict=True):
            plan = take_staging(st, plan_batch(req_to_token, st, rows, [lens[r] for r in rows],
                                               [lens[r] + news[r] for r in rows], window,
                                               obs_window=4))
            batch = impl.prepare(plan)
            outs.append([impl.forward(layer, batch, q, k, v, 0.125, n == len(rows))
                         for layer in range(2)])
            st.mark_sealed(plan.pages_to_seal)
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, **TOL[torch.float32])
        for r in rows:
            lens[r] += news[r]
        for r, end in enumerate(lens):
            for pos in range(0, end, P):
                page = int(req_to_token[r, pos]) // P
                stage = int(stores[0].page_to_stage[page])
                if stage >= 0 and end - pos < P:
                    for t in stores[0].stage_k + stores[0].stage_v:
                        assert torch.equal(t[stage, end - pos:], torch.zeros_like(t[stage, end - pos:]))

    step({0: 2 * P + 5, 1: 20})
    for i in range(2 * P + 3):
        step({0: 1, 1: 1} if i < P else {1: 1})
        if i == P - 1:  # request 0 finishes: its pages and staging pages are freed
            pages = req_to_token[0, :lens[0]:P] // P
            for st in stores:
                st.on_pages_freed(pages)
            free.extend(pages.tolist())
            lens[0] = 0
    held = stores[0].page_to_stage[stores[0].page_to_stage >= 0]
    for st in stores:  # NaN is left only in staging pages no request holds
        for t in st.stage_k + st.stage_v:
            assert not t[held].isnan().any()
            t.nan_to_num_(0.0)
    assert_same_state(*stores)
    stores[0].check_integrity(torch.tensor(free))


def test_gather_pages_copies_the_held_rows_and_zeros_the_rest():
    """tails.cpp's gather_pages (stage_fresh's native read-back): page m is the staging page
    pages[m]'s first rows[m] tokens, then zeros, whatever the staging page holds past them
    (NaN here); k and v alike, any dtype. Bad pages and row counts are refused by name."""
    gather = native.load().gather_pages
    for dtype in (torch.float32, torch.bfloat16):
        k_stage = torch.randn(7, 16, 3, 8).to(dtype)
        v_stage = torch.randn(7, 16, 3, 8).to(dtype)
        pages, rows = torch.tensor([5, 0, 5, 2]), torch.tensor([16, 3, 0, 9])
        for t in k_stage, v_stage:
            t[0, 3:] = float("nan")
            t[2, 9:] = float("nan")
        k, v = gather(k_stage, v_stage, pages, rows)
        for got, stage in (k, k_stage), (v, v_stage):
            assert got.shape == (4, 16, 3, 8) and got.dtype == dtype
            for m, (page, n) in enumerate(zip(pages.tolist(), rows.tolist(), strict=True)):
                assert torch.equal(got[m, :n], stage[page, :n])
                assert torch.equal(got[m, n:], torch.zeros_like(got[m, n:]))
    # Served page sizes (24 KB a SmolLM2 page, 96 KB at head size 128), one page or many, on
    # one thread or two (session 68 tried splitting the copy on the kernels' pool).
    gen = torch.Generator().manual_seed(5)
    for M, P, D in ((1, 64, 64), (2, 64, 64), (37, 64, 64), (9, 128, 128), (5, 16, 8)):
        k_stage = torch.randn(50, P, 3, D, generator=gen).bfloat16()
        v_stage = torch.randn(50, P, 3, D, generator=gen).bfloat16()
        pages = torch.randperm(50, generator=gen)[:M]
        rows = torch.randint(0, P + 1, (M,), generator=gen)
        for threads in (2, 1):
            with intra_op_threads(threads):
                k, v = gather(k_stage, v_stage, pages, rows)
            held = (torch.arange(P)[None, :] < rows[:, None])[:, :, None, None]
            assert torch.equal(k, torch.where(held, k_stage[pages], 0)), (M, P, D, threads)
            assert torch.equal(v, torch.where(held, v_stage[pages], 0)), (M, P, D, threads)
    stage = torch.zeros(3, 4, 1, 8)
    with pytest.raises(RuntimeError, match="page 3 is outside"):
        gather(stage, stage, torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="5 rows of page 0 are not in"):
        gather(stage, stage, torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(RuntimeError, match="2 pages but 1 row counts"):
        gather(stage, stage, torch.tensor([0, 1]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="one dtype"):
        gather(stage, stage.bfloat16(), torch.tensor([0]), torch.tensor([1]))
