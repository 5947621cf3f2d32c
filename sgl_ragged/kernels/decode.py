"""Decode attention over the ragged layout: split-KV over sealed rows, then tail + LSE merge.

One decode step, one layer, the whole batch, three launches:

1. `_sealed_splits_kernel`, grid (W, B): work item w = (group g, split s) from the static
   split map (aot.py); the program covers the s-th of S[l,g] equal shares of request b's
   sealed pages (whole pages; whole packed steps with launch.packed_pages) of group g -- their
   high slots, then each page's low tier on its codes (attend.attend_sealed) -- for each of
   the group's H_p heads, and writes partial outputs and log-sum-exps.
2. `_tail_kernel`, grid (B, H): attention of KV head h's query heads over the request's
   tail (staged tokens + the new token), written as one more partial.
3. `_merge_kernel`, grid (B, H_q, channel blocks): each query head's S[l,g] + 1 partials
   merged by log-sum-exp at once (one max, one weighted sum; no chain over the splits).

No planning at run time: the split counts are read from the device tensor S.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from sgl_ragged.kernels.aot import LayerSplits
from sgl_ragged.kernels.attend import attend_sealed, attend_tail
from sgl_ragged.kernels.batch import KernelBatch
from sgl_ragged.kernels.launch import (
    block_config,
    compiled_for_gpu,
    joined_safe,
    native_level,
    packed_pages,
    rows_contiguous,
    split_planes,
)
from sgl_ragged.kernels.occupancy import KernelResources
from sgl_ragged.kernels.quant import table_ptr
from sgl_ragged.kernels.tables import LayerTables, tl_dtype

DECODE_LAUNCH = {"rows": (2, 16, 2), "codes": (1, 16, 1), "packed": (2, 32, 1)}
"""(warps of the split kernel, BLOCK_N of the split and tail kernels, software-pipelining
stages of the split kernel) on a GPU: "rows" for layouts whose sealed rows are all in the model
dtype (drop-only), "codes" for layouts with a quantized tier. Warps and BLOCK_N: the fastest of
bench.decode_breakdown's sweep on an H200 at every measured shape, int4 for "codes"
(docs/results.md, "Decode attention on an H200"; 4 warps, BLOCK_N 32 before: 1.8-2.5x slower
for rows, 1.2-1.7x for codes with the same split map). Other quantized formats take int4's
launch unmeasured. Stages: chosen from the sm_90 builds alone, unmeasured (session 17: since
rows and codes load 16 bytes wide, Triton pipelines the tile loops; Triton 3.6 spills the int4
and int2 split kernels at its default of 3 stages at D = 128 and at 2 still spills int2; 1
stage spills nothing and still loads 16 bytes wide; the drop-only kernel at 2 keeps 128
registers at D = 128, 80 at D = 64; docs/results.md, "What the compiled kernels spend per
token"). Under the interpreter BLOCK_N stays block_config's. On a GPU, launch.joined_safe
raises BLOCK_N to 32 for 2- and 4-bit codes in 16-bit dots (1 warp, 32 tokens: 250-254
registers at D = 128, no spill, 8 programs per SM; session 18): at 16 their dots came out
wrong on an H100. "packed": quantized layouts with packed pages (launch.packed_pages, opt-in):
chosen from the sm_90 builds alone (session 35: at 1 warp the packed kernel spills 2 KB a
thread; at 2 warps and BLOCK_N 32 it spills nothing, 255 registers), untimed."""

MERGE_BLOCK_S = 32
"""Partials the merge kernel reads per tile."""


@triton.jit
def _sealed_splits_kernel(
    Q, s_qn, s_qh, rows_k_ptr, rows_v_ptr, slots, hi_slots, low_ptr, group_heads, split_counts,
    work_group, work_split, sealed_table, s_tb, num_sealed, q_start,
    Mid_O, Mid_L, s_ob, s_oh, s_os, s_lb, s_lh, scale,
    H_P: tl.constexpr, GSIZE: tl.constexpr, D: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr,
    NATIVE: tl.constexpr, HIGH_BITS: tl.constexpr, HIGH_FLOAT: tl.constexpr,
    PLANES: tl.constexpr, GP: tl.constexpr,
):
    w = tl.program_id(0)
    b = tl.program_id(1)
    g = tl.load(work_group + w)
    s = tl.load(work_split + w)
    hi_g = tl.load(hi_slots + g)
    lo_g = tl.load(slots + g) - hi_g
    # This split's share [p0, p1) of the request's sealed pages (whole pages: a page's low
    # tier shares its key parameters).
    n_pages = tl.load(num_sealed + b)
    chunk = tl.cdiv(n_pages, tl.load(split_counts + g))
    if GP > 0:
        # Packed pages (launch.packed_pages): shares of whole packed steps, so that no step
        # but a request's last runs with absent pages (fewer splits get work where a share
        # would be shorter than a step: 2 pages a share at 4 x 8K with uniform splits).
        chunk = tl.cdiv(chunk, BLOCK_G // GP) * (BLOCK_G // GP)
    p0 = s * chunk
    p1 = tl.maximum(tl.minimum(p0 + chunk, n_pages), p0)
    k_base = table_ptr(rows_k_ptr + g, DTYPE)
    v_base = table_ptr(rows_v_ptr + g, DTYPE)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = (offs_g < GSIZE)[:, None] & (offs_d < D)[None, :]
    # GP > 0 (launch.packed_pages): rows r * GP + g all hold query head g, one repeat per page
    # the low tier attends at once (attend._attend_low_packed).
    head_g = offs_g % GP if GP > 0 else offs_g
    row = tl.load(q_start + b).to(tl.int64)
    for j in tl.static_range(H_P):
        head0 = tl.load(group_heads + g * H_P + j) * GSIZE
        qh = head0 + offs_g  # [BLOCK_G] query heads
        q = tl.load(Q + row * s_qn + (head0 + head_g)[:, None] * s_qh + offs_d[None, :],
                    mask=(head_g < GSIZE)[:, None] & (offs_d < D)[None, :], other=0.0).to(DOT)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        m_i, l_i, acc = attend_sealed(q, m_i, l_i, acc, k_base, v_base, low_ptr + g * 12,
                                      sealed_table + b * s_tb, hi_g, lo_g, j, p0, p1, scale,
                                      H_P, D, BLOCK_N, BLOCK_D, PRECISION, LOW_BITS, LOW_FLOAT,
                                      NATIVE, HIGH_BITS, HIGH_FLOAT, PLANES, GP)
        # Empty share (short request): lse = -inf, output 0.
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(Mid_O + b * s_ob + qh[:, None] * s_oh + s * s_os + offs_d[None, :], o, mask=mask_q)
        tl.store(Mid_L + b * s_lb + qh * s_lh + s, lse, mask=offs_g < GSIZE)


@triton.jit
def _tail_kernel(
    Q, s_qn, s_qh, K_new, V_new, s_new, stage_k, stage_v, s_page, s_tok, P,
    stage_table, s_stb, num_staged, q_start, tail_slot,
    Mid_O, Mid_L, s_ob, s_oh, s_os, s_lb, s_lh, scale,
    GSIZE: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GSIZE
    mask_q = mask_g[:, None] & (offs_d < D)[None, :]
    row = tl.load(q_start + b).to(tl.int64)
    n_st = tl.load(num_staged + b)
    qh = h * GSIZE + offs_g
    q = tl.load(Q + row * s_qn + qh[:, None] * s_qh + offs_d[None, :], mask=mask_q,
                other=0.0).to(DOT)
    # The tail: staged tokens and the new one, all visible to the decode query (never empty).
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lim = tl.zeros([BLOCK_G], tl.int32) + n_st
    m_i, l_i, acc = attend_tail(q, m_i, l_i, acc, stage_k, stage_v, stage_table + b * s_stb, n_st,
                                P, s_page, s_tok, K_new, V_new, row, s_new, h, lim, n_st + 1,
                                scale, D, BLOCK_N, BLOCK_D, PRECISION)
    # One more partial, in the slot after every group's splits.
    tl.store(Mid_O + b * s_ob + qh[:, None] * s_oh + tail_slot * s_os + offs_d[None, :],
             acc / l_i[:, None], mask=mask_q)
    tl.store(Mid_L + b * s_lb + qh * s_lh + tail_slot, m_i + tl.log(l_i), mask=mask_g)


@triton.jit
def _merge_kernel(
    q_start, head_group, split_counts, tail_slot,
    Mid_O, Mid_L, s_ob, s_oh, s_os, s_lb, s_lh, Out, s_out_n, s_out_h, Lse, s_lse_n,
    GSIZE: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
):
    """Program (b, query head, channel block): the group's split partials and the tail's,
    reduced at once: one max over their log-sum-exps, one weighted sum of their outputs."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    dc = tl.program_id(2)
    n_split = tl.load(split_counts + tl.load(head_group + qh // GSIZE))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
    l_row = Mid_L + b * s_lb + qh * s_lh
    o_row = Mid_O + b * s_ob + qh * s_oh
    # Partials: splits [0, n_split) and the tail's slot; unused slots between hold garbage.
    m = tl.load(l_row + tail_slot)
    for s0 in range(0, n_split, BLOCK_S):
        s = s0 + offs_s
        m = tl.maximum(m, tl.max(tl.load(l_row + s, mask=s < n_split, other=float("-inf")), 0))
    w_tail = tl.exp(tl.load(l_row + tail_slot) - m)
    total = w_tail
    acc = w_tail * tl.load(o_row + tail_slot * s_os + offs_d, mask=offs_d < D, other=0.0)
    for s0 in range(0, n_split, BLOCK_S):
        s = s0 + offs_s
        w = tl.exp(tl.load(l_row + s, mask=s < n_split, other=float("-inf")) - m)  # [BLOCK_S]
        o = tl.load(o_row + s[:, None] * s_os + offs_d[None, :],
                    mask=(s < n_split)[:, None] & (offs_d < D)[None, :], other=0.0)
        total += tl.sum(w, 0)
        acc += tl.sum(w[:, None] * o, 0)
    row = tl.load(q_start + b).to(tl.int64)
    tl.store(Out + row * s_out_n + qh * s_out_h + offs_d, acc / total, mask=offs_d < D)
    if dc == 0:
        tl.store(Lse + row * s_lse_n + qh, m + tl.log(total))


def decode_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    stage_k: torch.Tensor, stage_v: torch.Tensor, tables: LayerTables, splits: LayerSplits,
    batch: KernelBatch, scale: float, out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    parts: Sequence[tuple[LayerTables, LayerSplits]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's decode attention for the whole batch (one new token per request).

    q: [N, H_q, D]; k_new, v_new: [N, H, D] this step's tokens (row q_start[b] of request b);
    stage_k, stage_v: [S, P, H, D] this layer's staging pages. Writes rows q_start[b] of
    out [N, H_q, D] (q's dtype) and lse [N, H_q] float32 (natural log); other rows untouched.
    parts: with a low format per group, (tables, splits) per format (tables.format_parts,
    LayerSplits.of_groups, both built once): the split kernel runs once per format over its
    groups' work items; tail and merge once, with the whole layer's tables and splits.
    """
    n, h_q, d = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(n, h_q, dtype=torch.float32, device=q.device) if lse is None else lse
    B = batch.batch_size
    if B == 0:
        return out, lse
    # mid_o: [B, H_q, S_max + 1, D], mid_l: [B, H_q, S_max + 1] float32 partials: slots
    # [0, S[l,g]) the group's splits, slot S_max the tail's (tail_merge).
    mid_o = torch.empty(B, h_q, splits.max_splits + 1, d, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(B, h_q, splits.max_splits + 1, dtype=torch.float32, device=q.device)
    for part, work in parts or ((tables, splits),):
        if work.num_work == 0:
            continue
        cfg, warps, stages = decode_launch(q, part, h_q // k_new.shape[1], d)
        args, options = _split_launch(q, part, work, batch, mid_o, mid_l, scale, cfg, warps,
                                      stages)
        _sealed_splits_kernel[(work.num_work, B)](*args, **options)
    tail_merge(q, k_new, v_new, stage_k, stage_v, tables, splits.split_counts, batch, mid_o,
               mid_l, scale, out, lse)
    return out, lse


def decode_launch(q: torch.Tensor, tables: LayerTables, gsize: int,
                  d: int) -> tuple[dict[str, object], int, int]:
    """Block sizes of the decode kernels for these rows, and the split kernel's warps and
    pipelining stages (DECODE_LAUNCH)."""
    cfg = block_config(q, gsize, d)
    kind = ("rows" if not (tables.low_bits or tables.high_bits)
            else "packed" if packed_pages(q, tables, cfg) else "codes")
    warps, block_n, stages = DECODE_LAUNCH[kind]
    if compiled_for_gpu(q):
        cfg["BLOCK_N"] = block_n
    return joined_safe(cfg, q, tables), warps, stages


def _split_launch(q: torch.Tensor, tables: LayerTables, splits: LayerSplits, batch: KernelBatch,
                  mid_o: torch.Tensor, mid_l: torch.Tensor, scale: float,
                  cfg: dict[str, object], warps: int,
                  stages: int) -> tuple[tuple, dict[str, object]]:
    """Arguments and compile-time options of `_sealed_splits_kernel` (launch and warm-up)."""
    args = (q, q.stride(0), q.stride(1), tables.rows_k_ptr, tables.rows_v_ptr, tables.slots,
            tables.hi_slots, tables.low_ptr, tables.group_heads, splits.split_counts,
            splits.work_group, splits.work_split, batch.sealed_table, batch.sealed_table.stride(0),
            batch.num_sealed, batch.q_start, mid_o, mid_l, *mid_o.stride()[:3],
            *mid_l.stride()[:2], scale)
    options = {"H_P": tables.heads_per_group, "DTYPE": tl_dtype(tables.rows_dtype), **cfg,
               "LOW_BITS": tables.low_bits, "LOW_FLOAT": tables.low_float,
               "HIGH_BITS": tables.high_bits, "HIGH_FLOAT": tables.high_float,
               "NATIVE": native_level(q, tables, cfg["BLOCK_N"], q.shape[-1], warps),
               "PLANES": split_planes(q, tables, q.shape[-1]),
               "GP": packed_pages(q, tables, cfg), "num_warps": warps, "num_stages": stages}
    return args, options


def split_kernel_resources(tables: LayerTables, splits: LayerSplits, num_q_heads: int,
                           head_dim: int, dtype: torch.dtype) -> KernelResources:
    """Compile the split kernel for these shapes (no launch) and read what one program uses:
    registers per thread, shared memory, warps. CUDA only (the interpreter compiles nothing)."""
    dev = tables.slots.device
    q = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=dev)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    batch = KernelBatch(q_start=one, q_len=one + 1, num_sealed=one, sealed_table=one[None],
                        num_staged=one, stage_table=one[None], max_q_len=1, max_sealed=0)
    mid_o = torch.empty(1, num_q_heads, splits.max_splits, head_dim, device=dev)
    mid_l = torch.empty(1, num_q_heads, splits.max_splits, device=dev)
    cfg, warps, stages = decode_launch(q, tables, num_q_heads // tables.group_heads.numel(),
                                       head_dim)
    args, options = _split_launch(q, tables, splits, batch, mid_o, mid_l, 1.0, cfg, warps,
                                  stages)
    kernel = _sealed_splits_kernel.warmup(*args, grid=(1, 1), **options)
    kernel._init_handles()  # loads the binary: fills n_regs
    return KernelResources(registers_per_thread=kernel.n_regs,
                           shared_bytes=kernel.metadata.shared, num_warps=warps)


def tail_merge(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, stage_k: torch.Tensor,
    stage_v: torch.Tensor, tables: LayerTables, split_counts: torch.Tensor, batch: KernelBatch,
    mid_o: torch.Tensor, mid_l: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor,
) -> None:
    """Step 2 alone: the tail's attention as one more partial, in the last slot of mid_o
    [B, H_q, S_max + 1, D] / mid_l [B, H_q, S_max + 1] float32 (natural-log LSE), then every
    query head's partials (split_counts [G] int32 splits of its group, slots [0, S[g]), and the
    tail's) merged in parallel into out and lse. Also the merge for any other sealed-part
    kernel (the FlashInfer baseline passes S = 1)."""
    h_q, d = q.shape[1:]
    h_kv = k_new.shape[1]
    cfg, _, _ = decode_launch(q, tables, h_q // h_kv, d)
    tail_slot = mid_o.shape[2] - 1
    k_new, v_new = rows_contiguous(k_new), rows_contiguous(v_new)
    mid = (mid_o, mid_l, *mid_o.stride()[:3], *mid_l.stride()[:2])
    _tail_kernel[(batch.batch_size, h_kv)](
        q, q.stride(0), q.stride(1), k_new, v_new, k_new.stride(0), stage_k, stage_v,
        stage_k.stride(0), stage_k.stride(1), stage_k.shape[1], batch.stage_table,
        batch.stage_table.stride(0), batch.num_staged, batch.q_start, tail_slot, *mid, scale,
        **cfg, num_warps=8,
    )
    block_dc = min(cfg["BLOCK_D"], 64)
    _merge_kernel[(batch.batch_size, h_q, triton.cdiv(d, block_dc))](
        batch.q_start, tables.head_group, split_counts, tail_slot, *mid, out, out.stride(0),
        out.stride(1), lse, lse.stride(0), GSIZE=cfg["GSIZE"], D=d, BLOCK_S=MERGE_BLOCK_S,
        BLOCK_DC=block_dc, num_warps=4,
    )
