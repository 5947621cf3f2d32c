"""Extend (prefill chunk / mixed batch) attention over the ragged layout.

One launch per layer for the whole batch, grid (ceil(max_q_len / BLOCK_M), B, H): program
(m, b, h) takes query tokens [m * BLOCK_M, (m + 1) * BLOCK_M) of request b and all query heads
of KV head h (rows r = token * BLOCK_G + query head), attends over h's sealed rows (group g,
member j) and then over the tail causally (staged tokens, then the chunk itself). Decode
requests in a mixed batch are requests with q_len = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from sgl_ragged.kernels.attend import attend_sealed, attend_tail
from sgl_ragged.kernels.batch import KernelBatch
from sgl_ragged.kernels.launch import (
    block_config,
    compiled_for_gpu,
    joined_safe,
    native_level,
    rows_contiguous,
    split_planes,
)
from sgl_ragged.kernels.quant import table_ptr
from sgl_ragged.kernels.tables import LayerTables, next_pow2, tl_dtype

EXTEND_WARPS = 8
"""Warps of the extend kernel."""


@triton.jit
def _extend_kernel(
    Q, s_qn, s_qh, K_new, V_new, s_new, stage_k, stage_v, s_page, s_tok, P,
    rows_k_ptr, rows_v_ptr, slots, hi_slots, low_ptr, head_group, head_member, heads,
    sealed_table, s_tb, num_sealed, stage_table, s_stb, num_staged, q_start, q_len,
    Out, s_out_n, s_out_h, Lse, s_lse_n, scale,
    H_P: tl.constexpr, GSIZE: tl.constexpr, D: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, LOW_BITS: tl.constexpr,
    LOW_FLOAT: tl.constexpr, NATIVE: tl.constexpr, HIGH_BITS: tl.constexpr,
    HIGH_FLOAT: tl.constexpr, PLANES: tl.constexpr,
):
    m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.load(heads + tl.program_id(2))  # KV head (LayerTables.heads)
    n_q = tl.load(q_len + b)
    if m * BLOCK_M >= n_q:
        return
    # Rows: query token i of the request, query head h * GSIZE + jq.
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    i = m * BLOCK_M + r // BLOCK_G
    qh = h * GSIZE + r % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    valid = (i < n_q) & (r % BLOCK_G < GSIZE)
    mask_q = valid[:, None] & (offs_d < D)[None, :]
    row0 = tl.load(q_start + b).to(tl.int64)
    q_rows = row0 + i
    q = tl.load(Q + q_rows[:, None] * s_qn + qh[:, None] * s_qh + offs_d[None, :], mask=mask_q,
                other=0.0).to(DOT)
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    # 1. Sealed rows of h: member j of group g, every sealed page visible to every query.
    g = tl.load(head_group + h)
    hi_g = tl.load(hi_slots + g)
    k_base = table_ptr(rows_k_ptr + g, DTYPE)
    v_base = table_ptr(rows_v_ptr + g, DTYPE)
    m_i, l_i, acc = attend_sealed(q, m_i, l_i, acc, k_base, v_base, low_ptr + g * 12,
                                  sealed_table + b * s_tb, hi_g, tl.load(slots + g) - hi_g,
                                  tl.load(head_member + h), 0, tl.load(num_sealed + b),
                                  scale, H_P, D, BLOCK_N, BLOCK_D, PRECISION, LOW_BITS, LOW_FLOAT,
                                  NATIVE, HIGH_BITS, HIGH_FLOAT, PLANES)
    # 2. The tail, causally: query i sees tail tokens t <= n_st + i.
    n_st = tl.load(num_staged + b)
    t_end = n_st + tl.minimum((m + 1) * BLOCK_M, n_q)
    m_i, l_i, acc = attend_tail(q, m_i, l_i, acc, stage_k, stage_v, stage_table + b * s_stb, n_st,
                                P, s_page, s_tok, K_new, V_new, row0, s_new, h, n_st + i, t_end,
                                scale, D, BLOCK_N, BLOCK_D, PRECISION)
    l_safe = tl.where(valid, l_i, 1.0)
    tl.store(Out + q_rows[:, None] * s_out_n + qh[:, None] * s_out_h + offs_d[None, :],
             acc / l_safe[:, None], mask=mask_q)
    tl.store(Lse + q_rows * s_lse_n + qh, m_i + tl.log(l_safe), mask=valid)


def extend_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    stage_k: torch.Tensor, stage_v: torch.Tensor, tables: LayerTables, batch: KernelBatch,
    scale: float, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    parts: Sequence[LayerTables] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's extend attention for the whole batch.

    q: [N, H_q, D]; k_new, v_new: [N, H, D] this forward's tokens (rows q_start[b] ..
    q_start[b] + q_len[b] - 1 of request b); stage_k, stage_v: [S, P, H, D] this layer's staging
    pages. Writes those rows of out [N, H_q, D] (q's dtype) and lse [N, H_q] float32 (natural
    log); other rows are left untouched. parts: with a low format per group
    (tables.format_parts), one launch per format over its groups' KV heads.
    """
    n, h_q, d = q.shape
    h_kv = k_new.shape[1]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(n, h_q, dtype=torch.float32, device=q.device) if lse is None else lse
    if batch.batch_size == 0 or batch.max_q_len == 0:
        return out, lse
    cfg = {**block_config(q, h_q // h_kv, d), "BLOCK_G": next_pow2(h_q // h_kv)}
    block_m = max(1, (64 if compiled_for_gpu(q) else 16) // cfg["BLOCK_G"])  # >= 16 rows for tl.dot
    k_new, v_new = rows_contiguous(k_new), rows_contiguous(v_new)
    for part in parts or (tables,):
        heads = part.heads
        part_cfg = joined_safe(cfg, q, part)
        grid = (triton.cdiv(batch.max_q_len, block_m), batch.batch_size, heads.numel())
        _extend_kernel[grid](
            q, q.stride(0), q.stride(1), k_new, v_new, k_new.stride(0), stage_k, stage_v,
            stage_k.stride(0), stage_k.stride(1), stage_k.shape[1],
            part.rows_k_ptr, part.rows_v_ptr, part.slots, part.hi_slots, part.low_ptr,
            part.head_group, part.head_member, heads, batch.sealed_table,
            batch.sealed_table.stride(0), batch.num_sealed, batch.stage_table,
            batch.stage_table.stride(0), batch.num_staged, batch.q_start, batch.q_len, out,
            out.stride(0), out.stride(1), lse, lse.stride(0), scale,
            H_P=part.heads_per_group, DTYPE=tl_dtype(part.rows_dtype), BLOCK_M=block_m,
            **part_cfg, LOW_BITS=part.low_bits, LOW_FLOAT=part.low_float,
            NATIVE=native_level(q, part, part_cfg["BLOCK_N"], d, EXTEND_WARPS),
            HIGH_BITS=part.high_bits, HIGH_FLOAT=part.high_float,
            PLANES=split_planes(q, part, d), num_warps=EXTEND_WARPS,
        )
    return out, lse
