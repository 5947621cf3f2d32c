"""Triton device functions shared by the decode and extend kernels: online-softmax steps over
a group's sealed rows and over a request's tail (staged tokens, then this forward's tokens).

Rows of `q` are query vectors (query heads of one KV head, possibly times query tokens); every
function carries the running max `m_i`, normalizer `l_i` [ROWS] float32 and the unnormalized
output `acc` [ROWS, BLOCK_D] float32 (FlashAttention's online softmax).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_ragged.kernels.quant import load_low


@triton.jit
def softmax_step(logits, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one block: logits [ROWS, BLOCK_N] float32 (masked = -inf), v [BLOCK_N, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(logits - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_sealed(q, m_i, l_i, acc, k_base, v_base, low_row, table_row, k_g, hi_g, j, start, end,
                  scale, H_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, LOW_BITS: tl.constexpr,
                  LOW_FLOAT: tl.constexpr):
    """Sealed tokens [start, end) of member head j of a group with k_g slots per page, the
    first hi_g of them full precision.

    Sealed token t is slot s = t % k_g of logical page table_row[t // k_g]: for s < hi_g its
    key is k_base[page, s, j, :] in the group's rows [pages, hi_g, H_p, D], else low-tier slot
    s - hi_g, dequantized here from the tensors at low_row (tables.LOW_TENSORS; LOW_BITS 0:
    the layout has no low tier and that path is not compiled).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        valid = t < end
        page = tl.load(table_row + t // k_g, mask=valid, other=0).to(tl.int64)
        slot = t % k_g
        hi = valid & (slot < hi_g)
        off = (page * hi_g + slot) * (H_P * D) + j * D
        mask = hi[:, None] & mask_d[None, :]
        k = tl.load(k_base + off[:, None] + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_base + off[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if LOW_BITS > 0:
            lo = valid & (slot >= hi_g)
            k_lo, v_lo = load_low(low_row, page, slot - hi_g, j, lo, H_P, D, BLOCK_D, LOW_BITS,
                                  LOW_FLOAT, k_g - hi_g)
            # Rounded to the rows' dtype, as quant.dequantize returns them.
            k = tl.where(lo[:, None], k_lo.to(k.dtype), k)
            v = tl.where(lo[:, None], v_lo.to(v.dtype), v)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_i, l_i, acc = softmax_step(logits, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def attend_tail(q, m_i, l_i, acc, stage_k, stage_v, stage_row, n_st, P, s_page, s_tok,
                k_new, v_new, new_row0, s_new, h, lim, t_end, scale,
                D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                PRECISION: tl.constexpr):
    """Tail tokens [0, t_end) of KV head h: t < n_st from the staging pages stage_row[t // P]
    (rows [S, P, H, D], strides s_page, s_tok; head stride D), the rest from rows
    new_row0 + t - n_st of this forward's k_new / v_new (token stride s_new). Row r of q sees
    tail tokens t <= lim[r] (causal)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    for t0 in range(0, t_end, BLOCK_N):
        t = t0 + offs_n
        staged = t < n_st
        new = (t >= n_st) & (t < t_end)
        page = tl.load(stage_row + t // P, mask=staged, other=0).to(tl.int64)
        s_off = page * s_page + (t % P) * s_tok + h * D
        n_off = (new_row0 + t - n_st).to(tl.int64) * s_new + h * D
        m_st = staged[:, None] & mask_d[None, :]
        m_new = new[:, None] & mask_d[None, :]
        k = tl.where(m_st, tl.load(stage_k + s_off[:, None] + offs_d[None, :], mask=m_st, other=0.0).to(q.dtype),
                     tl.load(k_new + n_off[:, None] + offs_d[None, :], mask=m_new, other=0.0).to(q.dtype))
        v = tl.where(m_st, tl.load(stage_v + s_off[:, None] + offs_d[None, :], mask=m_st, other=0.0).to(q.dtype),
                     tl.load(v_new + n_off[:, None] + offs_d[None, :], mask=m_new, other=0.0).to(q.dtype))
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (t[None, :] <= lim[:, None]) & (t < t_end)[None, :]
        logits = tl.where(visible, logits, float("-inf"))
        m_i, l_i, acc = softmax_step(logits, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc
