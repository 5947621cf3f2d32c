"""Triton decode and extend attention against the torch reference (torch_ref.request_forward).

Fresh random storages with random per-group budgets, ragged tails, empty sealed prefixes and
mixed batches; outputs are poisoned with NaN first, so every row the batch owns must be
written and every other row must stay NaN. Without a GPU the kernels run in Triton's
interpreter at small shapes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_ragged.attention_backend.torch_ref import request_forward
from sgl_ragged.kernels.aot import SplitStrategy, device_parallelism, split_plan
from sgl_ragged.kernels.batch import kernel_batch
from sgl_ragged.kernels.decode import MERGE_BLOCK_S, decode_attention
from sgl_ragged.kernels.extend import extend_attention
from sgl_ragged.kernels.tables import format_parts, layer_tables
from tests.unit.kernel_cases import (
    GPU,
    D,
    Shape,
    Spec,
    batch_rows,
    random_plans,
    random_qkv,
    random_storage,
    reference_lse,
)

SCALE = 1 / math.sqrt(D)
DECODE = [Spec(sealed=5, staged=3, q_len=1), Spec(0, 0, 1), Spec(2, 8, 1), Spec(9, 13, 1)]
MIXED = [Spec(sealed=3, staged=5, q_len=11), Spec(0, 0, 9), Spec(4, 2, 1), Spec(1, 8, 3)]
LOW = ["int8", "int4", "int2", "fp8", "int8+int4", "fp8+int2"]  # values with a low tier (pairs: quantized high tier too)


def _oracle(storage, layer, plans, q, k, v, out, lse, scale: float = SCALE) -> None:
    """Compare the kernel's rows with the reference, request by request (the reference also
    stages the tail afterwards, which the kernel never reads again)."""
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want_lse = reference_lse(storage, layer, p, q[rows], k[rows], scale)
        want = request_forward(storage, layer, p, q[rows], k[rows], v[rows], scale)
        torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse[rows].cpu(), want_lse, atol=2e-5, rtol=1e-4)


def _check_outputs(storage, plans, q, k, v, out, scale, tol) -> None:
    """Layer 0's outputs against the reference, request by request, within `tol`."""
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = request_forward(storage, 0, p, q[rows], k[rows], v[rows], scale)
        torch.testing.assert_close(out[rows].float(), want.float(), **tol)


def _poisoned(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    return out, lse


def _check_untouched(plans, out, lse) -> None:
    owned = batch_rows(plans, out.shape[0])
    assert out[owned].isfinite().all() and lse[owned].isfinite().all(), "a batch row was not written"
    assert out[~owned].isnan().all() and lse[~owned].isnan().all(), "a row outside the batch was written"


@pytest.mark.parametrize("strategy", list(SplitStrategy))
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_matches_reference(kernel_device, strategy, seed):
    _check_decode(kernel_device, strategy, seed, "bf16")


@pytest.mark.parametrize("precision", LOW)
def test_decode_low_tiers_match_reference(kernel_device, precision):
    """Rows with a low tier (random codes and parameters): dequantized in the kernel."""
    _check_decode(kernel_device, SplitStrategy.AOT, 2, precision)


def _check_decode(kernel_device, strategy, seed, precision):
    rng = random.Random(seed)
    storage = random_storage(rng, kernel_device, layers=2, precision=precision)
    assert storage.layout.quantized == (precision != "bf16")
    layer = 1
    plans = random_plans(storage, DECODE, rng, gap=1)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), kernel_device)
    ratios = [[rng.random() for _ in range(2)] for _ in range(2)]  # any split map is exact
    splits = split_plan(ratios, device_parallelism(kernel_device), kernel_device, strategy)
    out, lse = _poisoned(q)
    decode_attention(q, k, v, storage.stage_k[layer], storage.stage_v[layer],
                     layer_tables(storage, layer), splits.layer(layer),
                     kernel_batch(plans, kernel_device), SCALE, out, lse)
    _check_untouched(plans, out, lse)
    _oracle(storage, layer, plans, q, k, v, out, lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("precision", ["bf16", *LOW])
def test_decode_16_bit_rows(kernel_device, dtype, precision):
    """Rows, staging and activations in a 16-bit model dtype, as served: the dots multiply
    16-bit operands as a GPU build does (launch.block_config; emulated in the interpreter), so
    the queries with their key scales folded in and the scaled probabilities are rounded to
    the model dtype, and integer codes enter the dots as DOT numbers code + 2^m
    (quant.code_offset) whose offsets the kernel takes back out of the logits and outputs.
    Tolerance 2e-2 as for the GPU shapes: outputs of about unit size rounded to 16 bits a few
    times over (q * s, p * s_v, the output: 2^-8 relative each in bfloat16). Offsets taken
    back with the unrounded q * s or p * s_v instead fail here (int4 or int2 cases)."""
    rng = random.Random(31)
    storage = random_storage(rng, kernel_device, dtype=dtype, precision=precision)
    plans = random_plans(storage, DECODE, rng, gap=1)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(31), kernel_device, dtype)
    splits = split_plan([[0.5, 0.5]], device_parallelism(kernel_device), kernel_device)
    out, lse = _poisoned(q)
    decode_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], layer_tables(storage, 0),
                     splits.layer(0), kernel_batch(plans, kernel_device), SCALE, out, lse)
    _check_untouched(plans, out, lse)
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = request_forward(storage, 0, p, q[rows], k[rows], v[rows], SCALE).float()
        torch.testing.assert_close(out[rows].float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[rows].cpu(), reference_lse(storage, 0, p, q[rows],
                                                                  k[rows], SCALE),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_formats_one_launch_per_format(kernel_device, dtype):
    """A low format per group (--ragged-precision mixed): format_parts gives one table per
    format, covering each group and KV head once; the split kernel runs per part over its
    groups' work items (LayerSplits.of_groups), the extend kernel over its heads. Tolerances:
    float32 as the other float32 cases, bfloat16 as test_decode_16_bit_rows."""
    rng = random.Random(41)
    storage = random_storage(rng, kernel_device, dtype=dtype, precision="mixed")
    whole = layer_tables(storage, 0)
    parts = format_parts(whole, storage.layout, 0)
    assert len({p.low for p in parts}) == len(parts) > 1
    assert sorted(g for p in parts for g in p.groups) == list(range(whole.num_groups))
    assert sorted(h for p in parts for h in p.heads.tolist()) == list(range(4))
    splits = split_plan([[0.5, 0.5]], 6, kernel_device).layer(0)
    work = [splits.of_groups(p.groups) for p in parts]
    assert sum(w.num_work for w in work) == splits.num_work
    for p, w in zip(parts, work, strict=True):
        assert set(w.work_group.tolist()) <= set(p.groups)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for specs, attend in ((DECODE, "decode"), (MIXED, "extend")):
        plans = random_plans(storage, specs, rng, gap=1)
        q, k, v = random_qkv(plans, torch.Generator().manual_seed(41), kernel_device, dtype)
        out, lse = _poisoned(q)
        if attend == "decode":
            decode_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], whole, splits,
                             kernel_batch(plans, kernel_device), SCALE, out, lse,
                             parts=list(zip(parts, work, strict=True)))
        else:
            extend_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], whole,
                             kernel_batch(plans, kernel_device), SCALE, out, lse, parts=parts)
        _check_untouched(plans, out, lse)
        _check_outputs(storage, plans, q, k, v, out, SCALE, tol)


def test_tables_refuse_misaligned_rows(kernel_device):
    """The kernels load rows 16 bytes at a time (quant.table_ptr): a row tensor that starts
    off a 16-byte boundary is refused when the tables are built, not read wrongly."""
    storage = random_storage(random.Random(0), kernel_device)
    rows = storage.rows_k[0][0]
    shifted = torch.zeros(rows.numel() + 1, dtype=rows.dtype, device=rows.device)[1:]
    storage.rows_k[0][0] = shifted.view(rows.shape)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        layer_tables(storage, 0)


@pytest.mark.parametrize("heads_per_group", [1, 4])
def test_decode_more_splits_than_tokens(kernel_device, heads_per_group):
    """Most splits of a short request are empty (lse = -inf partials must merge away)."""
    rng = random.Random(7)
    storage = random_storage(rng, kernel_device, heads_per_group=heads_per_group)
    plans = random_plans(storage, [Spec(1, 2, 1), Spec(0, 7, 1)], rng)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(7), kernel_device)
    G = 4 // heads_per_group
    splits = split_plan([[1 / G] * G], 40, kernel_device)
    assert splits.layer(0).max_splits > 8
    out, lse = _poisoned(q)
    decode_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], layer_tables(storage, 0),
                     splits.layer(0), kernel_batch(plans, kernel_device), SCALE, out, lse)
    _check_untouched(plans, out, lse)
    _oracle(storage, 0, plans, q, k, v, out, lse)


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_decode_partials_span_merge_tiles(kernel_device, precision):
    """More non-empty splits than the merge kernel reads per tile (decode.MERGE_BLOCK_S), each
    a page or two of a long request, beside a short request whose splits are mostly empty."""
    rng = random.Random(11)
    storage = random_storage(rng, kernel_device, num_pages=96, precision=precision)
    plans = random_plans(storage, [Spec(70, 3, 1), Spec(2, 5, 1)], rng)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(11), kernel_device)
    splits = split_plan([[0.5, 0.5]], 160, kernel_device)
    assert splits.layer(0).max_splits > 2 * MERGE_BLOCK_S
    out, lse = _poisoned(q)
    decode_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], layer_tables(storage, 0),
                     splits.layer(0), kernel_batch(plans, kernel_device), SCALE, out, lse)
    _check_untouched(plans, out, lse)
    _oracle(storage, 0, plans, q, k, v, out, lse)


@pytest.mark.parametrize("seed,precision", [(0, "bf16"), (1, "bf16"), *((2, p) for p in LOW)])
def test_extend_mixed_batch_matches_reference(kernel_device, seed, precision):
    rng = random.Random(seed)
    storage = random_storage(rng, kernel_device, layers=2, precision=precision)
    assert storage.layout.quantized == (precision != "bf16")
    plans = random_plans(storage, MIXED, rng, gap=2)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), kernel_device)
    out, lse = _poisoned(q)
    extend_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], layer_tables(storage, 0),
                     kernel_batch(plans, kernel_device), SCALE, out, lse)
    _check_untouched(plans, out, lse)
    _oracle(storage, 0, plans, q, k, v, out, lse)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_rows_of_a_head_size_not_a_power_of_two(kernel_device, head_dim):
    """bf16 rows of head sizes the kernels pad to a power of two (BLOCK_D 128, masked
    channels): Phi-3-mini's 96, and 80. Quantized rows there are refused before any launch
    (registry.triton_refuses: their codes are packed at power-of-two widths), so auto serves
    them on the batched path. Decode (splits, tail, merge) and extend, float32."""
    shape = Shape(page_size=16, head_dim=head_dim, kv_heads=2, gqa=2)
    rng = random.Random(head_dim)
    storage = random_storage(rng, kernel_device, layers=2, shape=shape)
    scale = head_dim**-0.5
    for decode, specs in ((True, DECODE), (False, MIXED)):
        plans = random_plans(storage, specs, rng, gap=1)
        q, k, v = random_qkv(plans, torch.Generator().manual_seed(head_dim), kernel_device,
                             torch.float32, shape)
        out, lse = _poisoned(q)
        if decode:
            ratios = [[rng.random() for _ in groups] for groups in storage.layout.groups]
            splits = split_plan(ratios, device_parallelism(kernel_device), kernel_device)
            decode_attention(q, k, v, storage.stage_k[1], storage.stage_v[1],
                             layer_tables(storage, 1), splits.layer(1),
                             kernel_batch(plans, kernel_device), scale, out, lse)
        else:
            extend_attention(q, k, v, storage.stage_k[1], storage.stage_v[1],
                             layer_tables(storage, 1), kernel_batch(plans, kernel_device), scale,
                             out, lse)
        _check_untouched(plans, out, lse)
        _oracle(storage, 1, plans, q, k, v, out, lse, scale)


@pytest.mark.parametrize("seed,precision", [(3, "bf16"), (13, "int4"), (13, "int8+int4"),
                                            (13, "fp8+int2")])
def test_extend_low_precision_storage(kernel_device, seed, precision):
    """bfloat16 rows, staging and activations (the serving dtype); looser tolerance. With int4,
    one of seed 13's groups keeps no full-precision slot at all (every kept token quantized).
    With a pair (a quantized high tier; in float32 the small pages buy only a high tier) some
    group keeps both tiers."""
    rng = random.Random(seed)
    storage = random_storage(rng, kernel_device, dtype=torch.bfloat16, precision=precision)
    tiers = storage.layout.tiers[0]
    if "+" in precision:
        assert any(t.hi and t.lo for t in tiers) and storage.layout.high is not None
    else:
        assert any(t.hi == 0 for t in tiers) == (precision != "bf16")
    plans = random_plans(storage, [Spec(2, 3, 6), Spec(1, 0, 1)], rng)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), kernel_device, torch.bfloat16)
    out, _ = extend_attention(q, k, v, storage.stage_k[0], storage.stage_v[0],
                              layer_tables(storage, 0), kernel_batch(plans, kernel_device), SCALE)
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = request_forward(storage, 0, p, q[rows], k[rows], v[rows], SCALE).float()
        torch.testing.assert_close(out[rows].float(), want, atol=2e-2, rtol=2e-2)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU shapes need CUDA")


@needs_cuda
@pytest.mark.parametrize("strategy,precision", [*((s, "bf16") for s in SplitStrategy),
                                                *((SplitStrategy.AOT, p) for p in LOW),
                                                (SplitStrategy.AOT, "mixed")])
def test_decode_gpu_shapes(strategy, precision):
    """Serving shapes (P 64, D 128, 8 KV heads, GQA 4, bfloat16), the device's real N_CTA."""
    rng = random.Random(21)
    storage = random_storage(rng, "cuda", layers=2, num_pages=512, num_stages=16,
                             dtype=torch.bfloat16, shape=GPU, precision=precision)
    assert storage.layout.quantized == (precision != "bf16")
    specs = [Spec(100, 70, 1), Spec(3, 0, 1), Spec(0, 5, 1), Spec(250, 127, 1)]
    plans = random_plans(storage, specs, rng)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(21), "cuda", torch.bfloat16, GPU)
    ratios = [[rng.random() for _ in range(4)] for _ in range(2)]
    splits = split_plan(ratios, device_parallelism("cuda"), "cuda", strategy)
    scale = GPU.head_dim**-0.5
    tables = layer_tables(storage, 1)
    parts = [(t, splits.layer(1).of_groups(t.groups))
             for t in format_parts(tables, storage.layout, 1)]
    out, _ = decode_attention(q, k, v, storage.stage_k[1], storage.stage_v[1], tables,
                              splits.layer(1), kernel_batch(plans, "cuda"), scale, parts=parts)
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = request_forward(storage, 1, p, q[rows], k[rows], v[rows], scale)
        torch.testing.assert_close(out[rows].float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", *LOW, "mixed"])
def test_extend_gpu_shapes(precision):
    rng = random.Random(22)
    storage = random_storage(rng, "cuda", num_pages=512, num_stages=32, dtype=torch.bfloat16,
                             shape=GPU, precision=precision)
    assert storage.layout.quantized == (precision != "bf16")
    specs = [Spec(60, 30, 300), Spec(0, 0, 129), Spec(7, 64, 1), Spec(200, 1, 64)]
    plans = random_plans(storage, specs, rng)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(22), "cuda", torch.bfloat16, GPU)
    scale = GPU.head_dim**-0.5
    tables = layer_tables(storage, 0)
    out, _ = extend_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], tables,
                              kernel_batch(plans, "cuda"), scale,
                              parts=format_parts(tables, storage.layout, 0))
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        want = request_forward(storage, 0, p, q[rows], k[rows], v[rows], scale)
        torch.testing.assert_close(out[rows].float(), want.float(), atol=2e-2, rtol=2e-2)


# Every precision once, the (dtype, GQA) pairs in turn so that each of the four comes up (all
# 28 combinations took 13-18 minutes of a clean-clone CI's unit-b on a 2-core Zen 1, session 51,
# for a kernel that is opt-in).
PACKED_CASES = [(precision, (torch.float32, torch.bfloat16)[i % 2], (2, 3)[i // 2 % 2])
                for i, precision in enumerate([*LOW, "mixed"])]


@pytest.mark.parametrize("precision,dtype,gqa", PACKED_CASES,
                         ids=[f"{p}-{str(d).removeprefix('torch.')}-gqa{g}" for p, d, g in PACKED_CASES])
def test_packed_pages_match_reference(kernel_device, monkeypatch, precision, dtype, gqa):
    """RAGGED_TRITON_PACK=1 (launch.packed_pages): the decode split kernel attends
    BLOCK_G / GP low-tier pages at once, one per repeat of the query heads' rows
    (attend._attend_low_packed: 8 pages at GQA 2, 4 at GQA 3, whose fourth head row is
    padding), each with its own softmax, merged per head at the end. Random split maps give
    shares of pages that are not a multiple of the pack (a last step with absent pages), empty
    shares and groups without low slots. The same arithmetic per page as unpacked, merged in
    another order: float32 as tight as the other float32 cases, 16-bit as
    test_decode_16_bit_rows."""
    monkeypatch.setenv("RAGGED_TRITON_PACK", "1")
    from sgl_ragged.kernels.launch import block_config, packed_pages

    shape = Shape(gqa=gqa)
    rng = random.Random(53 + gqa)
    storage = random_storage(rng, kernel_device, layers=3, dtype=dtype, precision=precision,
                             shape=shape)
    # A layer with low slots (random budgets can leave a layer none).
    layer = next(i for i in range(3) if layer_tables(storage, i).low is not None)
    tables = layer_tables(storage, layer)
    parts = format_parts(tables, storage.layout, layer)
    h_q = shape.kv_heads * gqa
    probe = torch.zeros(1, h_q, shape.head_dim, dtype=dtype)
    gp = packed_pages(probe, tables, block_config(probe, gqa, shape.head_dim))
    assert gp == (2 if gqa == 2 else 4)  # the packed kernel is the one under test
    tol = ({"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32
           else {"atol": 2e-2, "rtol": 2e-2})
    for seed in (0, 1):
        plans = random_plans(storage, DECODE, rng, gap=1)
        q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), kernel_device, dtype,
                             shape)
        ratios = [[rng.random() for _ in range(2)]]
        whole = split_plan(ratios, device_parallelism(kernel_device), kernel_device).layer(0)
        out, lse = _poisoned(q)
        decode_attention(q, k, v, storage.stage_k[layer], storage.stage_v[layer], tables, whole,
                         kernel_batch(plans, kernel_device), SCALE, out, lse,
                         parts=[(t, whole.of_groups(t.groups)) for t in parts])
        _check_untouched(plans, out, lse)
        for p in plans:
            rows = slice(p.q_start, p.q_start + p.q_len)
            want = request_forward(storage, layer, p, q[rows], k[rows], v[rows], SCALE)
            torch.testing.assert_close(out[rows].float(), want.float(), **tol)
            if dtype == torch.float32:
                want_lse = reference_lse(storage, layer, p, q[rows], k[rows], SCALE)
                torch.testing.assert_close(lse[rows].cpu(), want_lse, **tol)


PLANES_SHAPE = Shape(head_dim=64)  # int2 planes are 16 channels wide: a dot's smallest side


# int2 (planes 16 channels wide, a dot's smallest side) in both dtypes, the others in one each
# (opt-in like packed pages; ten cases took 5-7 minutes of that CI's unit-b).
PLANES_CASES = [("int2", torch.float32), ("int2", torch.bfloat16), ("int4", torch.bfloat16),
                ("int8+int4", torch.float32), ("fp8+int2", torch.bfloat16), ("mixed", torch.float32)]


@pytest.mark.parametrize("precision,dtype", PLANES_CASES,
                         ids=[f"{p}-{str(d).removeprefix('torch.')}" for p, d in PLANES_CASES])
def test_split_planes_match_reference(kernel_device, monkeypatch, precision, dtype):
    """RAGGED_TRITON_PLANES=1 (launch.split_planes): 2- and 4-bit tiers attended one dot per
    bit plane (attend._attend_code_pages), decode and extend, against the reference. The same
    arithmetic as the joined planes, summed in another order: float32 as tight as the other
    float32 cases, 16-bit as test_decode_16_bit_rows."""
    monkeypatch.setenv("RAGGED_TRITON_PLANES", "1")
    from sgl_ragged.kernels.launch import split_planes

    rng = random.Random(41)
    storage = random_storage(rng, kernel_device, dtype=dtype, precision=precision,
                             shape=PLANES_SHAPE)
    tables = layer_tables(storage, 0)
    parts = format_parts(tables, storage.layout, 0)
    q_probe = torch.zeros(1, 1, PLANES_SHAPE.head_dim, dtype=dtype)
    assert any(split_planes(q_probe, t, PLANES_SHAPE.head_dim) for t in parts)
    tol = ({"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32
           else {"atol": 2e-2, "rtol": 2e-2})
    scale = PLANES_SHAPE.head_dim**-0.5
    for specs in (DECODE, MIXED):
        plans = random_plans(storage, specs, rng, gap=1)
        q, k, v = random_qkv(plans, torch.Generator().manual_seed(41), kernel_device, dtype,
                             PLANES_SHAPE)
        out, lse = _poisoned(q)
        if specs is DECODE:
            splits = split_plan([[0.5, 0.5]], device_parallelism(kernel_device), kernel_device)
            whole = splits.layer(0)
            decode_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], tables, whole,
                             kernel_batch(plans, kernel_device), scale, out, lse,
                             parts=[(t, whole.of_groups(t.groups)) for t in parts])
        else:
            extend_attention(q, k, v, storage.stage_k[0], storage.stage_v[0], tables,
                             kernel_batch(plans, kernel_device), scale, out, lse, parts=parts)
        _check_untouched(plans, out, lse)
        _check_outputs(storage, plans, q, k, v, out, scale, tol)
