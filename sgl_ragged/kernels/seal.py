"""Sealing kernel: per-head top-k inside each page, then gather K/V into the group rows.

Scores come from the scorer (torch); the kernel does the selection and the copy, one launch
per layer for all pages sealed by the forward, grid (N pages, H KV heads). The top-k is
computed in the kernel by ranks: token i's rank is the number of tokens j with
f_j > f_i or (f_j == f_i and j < i), where f = score with sinks forced to +inf; i is kept iff
rank < k[l][g]. That is exactly `select_top_k` (a stable descending sort: earlier position wins
ties). Kept token i goes to row slot #{kept j < i}, so slots stay in position order. Scores must
not be NaN. O(P^2) comparisons per (page, head): 4096 for P = 64.

With a low tier (docs/architecture.md, "Row tiers") the tokens of rank < hi[l][g] are the full-precision
tier and the other kept ones the low tier (`select_tiers`), each in position order; the kernel
quantizes and packs the low tier in place (kernels/quant.py: keys per channel over the page's
low-tier tokens, values per token, as `quant.quantize`), and the high tier the same way when it
is quantized too (--ragged-precision H+L: HIGH_BITS > 0, tables.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from sgl_ragged.kernels.launch import rows_contiguous
from sgl_ragged.kernels.quant import store_low, table_ptr
from sgl_ragged.kernels.tables import LayerTables, next_pow2, tl_dtype


@triton.jit
def _seal_kernel(
    Src_K, Src_V, s_src_n, s_src_t, src_index, pages, Scores, s_sc_n, s_sc_h, Sinks, s_si_n,
    rows_k_ptr, rows_v_ptr, slots, hi_slots, low_ptr, head_group, head_member, heads, P,
    H_P: tl.constexpr, D: tl.constexpr, DTYPE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr,
    HIGH_BITS: tl.constexpr, HIGH_FLOAT: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.load(heads + tl.program_id(1))  # KV head (LayerTables.heads)
    g = tl.load(head_group + h)
    j = tl.load(head_member + h)
    k_g = tl.load(slots + g)
    hi_g = tl.load(hi_slots + g)
    offs = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    in_page = offs < P
    # 1. Scores with sinks forced in.
    score = tl.load(Scores + n * s_sc_n + h * s_sc_h + offs, mask=in_page, other=float("-inf"))
    sink = tl.load(Sinks + n * s_si_n + offs, mask=in_page, other=0) != 0
    f = tl.where(sink, float("inf"), score)
    # 2. Rank in a stable descending order; keep the first k_g, the first hi_g at full precision.
    ahead = (f[None, :] > f[:, None]) | ((f[None, :] == f[:, None]) & (offs[None, :] < offs[:, None]))
    rank = tl.sum((ahead & in_page[None, :]).to(tl.int32), 1)
    hi = (rank < hi_g) & in_page
    lo = (rank >= hi_g) & (rank < k_g) & in_page
    # 3. Slot of each token in its tier: tokens of the tier before it.
    before = offs[None, :] < offs[:, None]
    slot = tl.sum((before & hi[None, :]).to(tl.int32), 1)
    # 4. Gather the page's K/V of head h, scatter the hi tier into rows[page, slot, j, :].
    src = tl.load(src_index + n).to(tl.int64)
    page = tl.load(pages + n).to(tl.int64)
    mask_d = offs_d < D
    src_off = src * s_src_n + offs[:, None] * s_src_t + h * D + offs_d[None, :]
    dst_off = ((page * hi_g + slot) * (H_P * D) + j * D)[:, None] + offs_d[None, :]
    load_mask = in_page[:, None] & mask_d[None, :]
    store_mask = hi[:, None] & mask_d[None, :] & (page >= 0)  # page -1: a padding entry
    x_k = tl.load(Src_K + src_off, mask=load_mask, other=0.0)
    x_v = tl.load(Src_V + src_off, mask=load_mask, other=0.0)
    if HIGH_BITS > 0:  # a quantized high tier (columns 6-11 of the low_ptr row)
        if hi_g > 0:
            store_low(x_k.to(tl.float32), x_v.to(tl.float32), hi, slot, page, j, hi_g,
                      low_ptr + g * 12 + 6, H_P, D, BLOCK_P, HIGH_BITS, HIGH_FLOAT)
    else:
        k_base = table_ptr(rows_k_ptr + g, DTYPE)
        v_base = table_ptr(rows_v_ptr + g, DTYPE)
        tl.store(k_base + dst_off, x_k, mask=store_mask)
        tl.store(v_base + dst_off, x_v, mask=store_mask)
    # 5. Quantize the low tier into its slots (groups without one have k_g == hi_g).
    if LOW_BITS > 0:
        if hi_g < k_g:
            lo_slot = tl.sum((before & lo[None, :]).to(tl.int32), 1)
            store_low(x_k.to(tl.float32), x_v.to(tl.float32), lo, lo_slot, page, j, k_g - hi_g,
                      low_ptr + g * 12, H_P, D, BLOCK_P, LOW_BITS, LOW_FLOAT)


def seal_pages(
    tables: LayerTables, src_k: torch.Tensor, src_v: torch.Tensor, src_index: torch.Tensor,
    pages: torch.Tensor, scores: torch.Tensor, sinks: torch.Tensor,
    parts: Sequence[LayerTables] = (),
) -> None:
    """Write the rows of N sealed pages of one layer (the kernel form of the storage's torch row
    writer, `RaggedStorage.write_sealed` with a TierRows `Selection`; triton_impl.KernelRowWriter).

    src_k, src_v: [M, P, H, D] full K/V of candidate pages (any float dtype; cast on store);
    src_index: [N] int rows of src_k/src_v to seal; pages: [N] int logical pages to write
    (-1 writes nothing: the padding entries of a captured decode graph, attention_backend/graph.py);
    scores: [N, H, P] float32 token scores; sinks: [N, P] bool (`sink_mask`). parts: with a
    low format per group (tables.format_parts), one launch per format over its groups' heads.
    """
    n = pages.numel()
    if n == 0:
        return
    _, P, _, d = src_k.shape
    src_k, src_v = rows_contiguous(src_k), rows_contiguous(src_v)
    scores = scores.float().contiguous()
    sinks = sinks.to(torch.int8).contiguous()
    src_index, pages = src_index.contiguous(), pages.contiguous()
    for part in parts or (tables,):
        heads = part.heads
        _seal_kernel[(n, heads.numel())](
            src_k, src_v, src_k.stride(0), src_k.stride(1), src_index, pages,
            scores, scores.stride(0), scores.stride(1), sinks, sinks.stride(0),
            part.rows_k_ptr, part.rows_v_ptr, part.slots, part.hi_slots, part.low_ptr,
            part.head_group, part.head_member, heads, P, H_P=part.heads_per_group, D=d,
            DTYPE=tl_dtype(part.rows_dtype), BLOCK_P=next_pow2(P), BLOCK_D=next_pow2(d),
            LOW_BITS=part.low_bits, LOW_FLOAT=part.low_float, HIGH_BITS=part.high_bits,
            HIGH_FLOAT=part.high_float, num_warps=8,
        )
