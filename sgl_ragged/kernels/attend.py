"""Triton device functions shared by the decode and extend kernels: online-softmax steps over
a group's sealed rows and over a request's tail (staged tokens, then this forward's tokens).

Rows of `q` are query vectors (query heads of one KV head, possibly times query tokens); every
function carries the running max `m_i`, normalizer `l_i` [ROWS] float32 and the unnormalized
output `acc` [ROWS, BLOCK_D] float32 (FlashAttention's online softmax).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_ragged.kernels.quant import (
    code_offset,
    code_planes,
    code_ptr,
    interleaved,
    interleaved_channels,
    low_codes,
    param_ptr,
    planar,
    split_planes,
)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr):
    """tl.dot(a, b) with a float32 result (block_config's PRECISION). "emulate" (16-bit
    operands in the CPU interpreter, whose own 16-bit matmul is not numeric): the operands'
    exact float32 values multiplied in float32, as a tensor core multiplies them."""
    if PRECISION == "emulate":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def softmax_step(logits, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one block: logits [ROWS, BLOCK_N] float32 (masked = -inf), v [BLOCK_N, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(logits - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = rescaled(acc, alpha, m_new > m_i) + mma(p.to(v.dtype), v, PRECISION)
    return m_new, l_i, acc


@triton.jit
def rescaled(acc, alpha, grew):
    """acc * alpha[:, None], skipped where no row's running max grew (grew [ROWS]): alpha is
    then exactly 1 on every row (0 on rows with nothing visible yet, whose acc is 0), so the
    result is the same bits. After a split's first tiles most tiles raise no max, and the
    multiply is a [ROWS, BLOCK_D] float32 pass per tile (half of a code tile's float work)."""
    if tl.max(grew.to(tl.int32), 0) > 0:
        acc = acc * alpha[:, None]
    return acc


@triton.jit
def attend_sealed(q, m_i, l_i, acc, k_base, v_base, low_row, table_row, hi_g, lo_g, j, p0, p1,
                  scale, H_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, LOW_BITS: tl.constexpr,
                  LOW_FLOAT: tl.constexpr, NATIVE: tl.constexpr, HIGH_BITS: tl.constexpr,
                  HIGH_FLOAT: tl.constexpr, PLANES: tl.constexpr, GP: tl.constexpr = 0):
    """Member head j's sealed pages table_row[p0:p1] of a group with hi_g high and lo_g
    low-tier slots per page: first every page's high slots (k_base / v_base rows
    [pages, hi_g, H_p, D]; with HIGH_BITS > 0 a quantized high tier, read on its codes like the
    low one through columns 6-11 of the low_ptr row, tables.py), then each page's low tier on
    its codes (LOW_BITS 0: the layout has no low tier and that loop is not compiled). PLANES
    (launch.split_planes): 2- and 4-bit tiers plane by plane (_attend_code_pages). GP > 0
    (decode, launch.packed_pages): q's rows are its GP query-head rows repeated, and the low
    tier attends ROWS // GP pages at once, one per repeat (_attend_low_packed)."""
    if split_planes(PLANES, HIGH_BITS, HIGH_FLOAT):
        p_hi = tl.where(hi_g > 0, p1, p0)
        m_i, l_i, acc = _attend_code_pages(q, m_i, l_i, acc, low_row + 6, table_row, p0, p_hi,
                                           hi_g, j, scale, H_P, D, BLOCK_N, PRECISION,
                                           HIGH_BITS, NATIVE)
    elif HIGH_BITS > 0:
        p_hi = tl.where(hi_g > 0, p1, p0)  # no high slots: no high-tier tensors
        # q and acc in the codes' channel order for the tier's pages (quant.interleaved).
        q_hi = interleaved(q, HIGH_BITS, HIGH_FLOAT, q.dtype)
        acc = interleaved(acc, HIGH_BITS, HIGH_FLOAT, q.dtype)
        for pi in range(p0, p_hi):
            page = tl.load(table_row + pi).to(tl.int64)
            m_i, l_i, acc = _attend_low_page(q_hi, m_i, l_i, acc, low_row + 6, page, hi_g, j, scale,
                                             H_P, D, BLOCK_N, BLOCK_D, PRECISION, HIGH_BITS,
                                             HIGH_FLOAT, NATIVE)
        acc = planar(acc, HIGH_BITS, HIGH_FLOAT, q.dtype)
    else:
        m_i, l_i, acc = _attend_high(q, m_i, l_i, acc, k_base, v_base, table_row, hi_g, j, p0,
                                     p1, scale, H_P, D, BLOCK_N, BLOCK_D, PRECISION)
    if split_planes(PLANES, LOW_BITS, LOW_FLOAT):
        p_lo = tl.where(lo_g > 0, p1, p0)
        m_i, l_i, acc = _attend_code_pages(q, m_i, l_i, acc, low_row, table_row, p0, p_lo, lo_g,
                                           j, scale, H_P, D, BLOCK_N, PRECISION, LOW_BITS,
                                           NATIVE)
    elif LOW_BITS > 0 and GP > 0:
        p_lo = tl.where(lo_g > 0, p1, p0)
        q_lo = interleaved(q, LOW_BITS, LOW_FLOAT, q.dtype)
        acc = interleaved(acc, LOW_BITS, LOW_FLOAT, q.dtype)
        m_i, l_i, acc = _attend_low_packed(q_lo, m_i, l_i, acc, low_row, table_row, p0, p_lo,
                                           lo_g, j, scale, GP, H_P, D, BLOCK_N, PRECISION,
                                           LOW_BITS, LOW_FLOAT, NATIVE)
        acc = planar(acc, LOW_BITS, LOW_FLOAT, q.dtype)
    elif LOW_BITS > 0:
        # A group without low slots has no low-tier tensors (null addresses): skip its pages.
        p_lo = tl.where(lo_g > 0, p1, p0)
        q_lo = interleaved(q, LOW_BITS, LOW_FLOAT, q.dtype)
        acc = interleaved(acc, LOW_BITS, LOW_FLOAT, q.dtype)
        for pi in range(p0, p_lo):
            page = tl.load(table_row + pi).to(tl.int64)
            m_i, l_i, acc = _attend_low_page(q_lo, m_i, l_i, acc, low_row, page, lo_g, j, scale,
                                             H_P, D, BLOCK_N, BLOCK_D, PRECISION, LOW_BITS,
                                             LOW_FLOAT, NATIVE)
        acc = planar(acc, LOW_BITS, LOW_FLOAT, q.dtype)
    return m_i, l_i, acc


@triton.jit
def _attend_high(q, m_i, l_i, acc, k_base, v_base, table_row, hi_g, j, p0, p1, scale,
                 H_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """The high slots of pages [p0, p1) as one run of tokens: token t is slot t % hi_g of
    page table_row[p0 + t // hi_g] (tiles straddle pages; nothing to fold)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    n_hi = (p1 - p0) * hi_g
    for t0 in range(0, n_hi, BLOCK_N):
        t = t0 + offs_n
        valid = t < n_hi
        page = tl.load(table_row + p0 + t // hi_g, mask=valid, other=0).to(tl.int64)
        off = (page * hi_g + t % hi_g) * (H_P * D) + j * D
        mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_base + off[:, None] + offs_d[None, :], mask=mask, other=0.0).to(q.dtype)
        v = tl.load(v_base + off[:, None] + offs_d[None, :], mask=mask, other=0.0).to(q.dtype)
        logits = mma(q, tl.trans(k), PRECISION) * scale
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_i, l_i, acc = softmax_step(logits, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_low_page(q, m_i, l_i, acc, low_row, page, lo_g, j, scale, H_P: tl.constexpr,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr,
                     NATIVE: tl.constexpr):
    """Logical page `page`'s lo_g slots of a quantized tier (low_row: its six addresses) of
    member head j, attended on the codes (docs/architecture.md, "Row tiers"): keys
    k = code * s + z per channel, so q . k = (q * s) . code + q . z with q * s and q . z once
    per page; values v = code * s_t + z_t per token, so
    sum_t p_t v_t = sum_t (p_t s_t) code_t + sum_t p_t z_t.

    q [ROWS, D] and acc [ROWS, D] are in `low_codes`' channel order (quant.interleaved; the
    caller puts them there once for all of a split's pages, and acc back with quant.planar)."""
    tl.static_assert(BLOCK_D == D, "low tiers need a power-of-two head size of at least 16")
    CB: tl.constexpr = D * LOW_BITS // 8
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CB)
    # 1. The page's key parameters, folded into the query: q_s [ROWS, D], bias [ROWS] float32.
    chan = (page * H_P + j) * D + interleaved_channels(D, LOW_BITS, LOW_FLOAT, q.dtype)
    q32 = q.to(tl.float32)
    q_s = (q32 * tl.load(param_ptr(low_row, 1) + chan).to(tl.float32)[None, :]).to(q.dtype)
    if LOW_FLOAT:
        bias = tl.zeros([q.shape[0]], tl.float32)
    else:
        bias = tl.sum(q32 * tl.load(param_ptr(low_row, 2) + chan).to(tl.float32)[None, :], 1)
    # low_codes' values are code + OFFSET: q_s . (code + OFFSET) = q_s . code + OFFSET sum(q_s).
    OFFSET: tl.constexpr = code_offset(LOW_BITS, LOW_FLOAT, q.dtype)
    if OFFSET != 0.0:
        bias -= OFFSET * tl.sum(q_s.to(tl.float32), 1)
    # 2. Its low slots, BLOCK_N at a time: codes read once each, for every query row. The zero
    # points' term, the same for every channel, is a [ROWS] sum added to acc at the end.
    shift = tl.zeros([q.shape[0]], tl.float32)
    for s0 in range(0, lo_g, BLOCK_N):
        slot = s0 + offs_n
        valid = slot < lo_g
        tok = (page * lo_g + slot) * H_P + j  # [BLOCK_N] (page, slot, head) entries
        byte = tok[:, None] * CB + offs_c[None, :]
        k = low_codes(tl.load(code_ptr(low_row, 0) + byte, mask=valid[:, None], other=0),
                      BLOCK_N, D, LOW_BITS, LOW_FLOAT, NATIVE, q.dtype)
        logits = (mma(q_s, tl.trans(k), PRECISION) + bias[:, None]) * scale
        logits = tl.where(valid[None, :], logits, float("-inf"))
        v = low_codes(tl.load(code_ptr(low_row, 3) + byte, mask=valid[:, None], other=0),
                      BLOCK_N, D, LOW_BITS, LOW_FLOAT, NATIVE, q.dtype)
        v_scale = tl.load(param_ptr(low_row, 4) + tok, mask=valid, other=0.0).to(tl.float32)
        if LOW_FLOAT:
            v_zero = tl.zeros([BLOCK_N], tl.float32)
        else:
            v_zero = tl.load(param_ptr(low_row, 5) + tok, mask=valid, other=0.0).to(tl.float32)
        m_i, l_i, acc, shift = _softmax_step_folded(logits, v, v_scale, v_zero, m_i, l_i, acc,
                                                    shift, PRECISION, OFFSET)
    return m_i, l_i, acc + shift[:, None]


@triton.jit
def _attend_low_packed(q, m_i, l_i, acc, low_row, table_row, p0, p1, lo_g, j, scale,
                       GP: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, LOW_BITS: tl.constexpr,
                       LOW_FLOAT: tl.constexpr, NATIVE: tl.constexpr):
    """Pages table_row[p0:p1] of member head j's quantized low tier (lo_g slots a page, low_row
    its six addresses), PACK = ROWS // GP pages at once: a decode program's rows are its GP
    query heads repeated PACK times (q [ROWS, D], row r * GP + g = head g, in `low_codes`'
    channel order; rows of padded heads zero), and repeat r attends page pi + r of each step
    with its own online softmax. `_attend_low_page`'s arithmetic, page by page, but with the
    rows a tensor core's dot pads to (16) filled: one fold of the key parameters into q for
    PACK pages, one softmax over [ROWS, BLOCK_N] logits for PACK tiles of tokens (each row's
    logits from its own page's dot), and each page's values dotted with the probabilities of
    its own rows (the others zeroed), where a program of GP < 16 heads otherwise folds,
    exponentiates and rescales 16 rows of which GP are used. At the end the PACK softmaxes
    of each head are merged (one max, one weighted sum) into every repeat of its row.

    m_i, l_i, acc: the state so far, read from rows [0, GP) (repeat 0; the other rows are
    restarted)."""
    ROWS: tl.constexpr = q.shape[0]
    PACK: tl.constexpr = ROWS // GP
    OFFSET: tl.constexpr = code_offset(LOW_BITS, LOW_FLOAT, q.dtype)
    rows = tl.arange(0, ROWS)
    rep = rows // GP  # the page of a step each row attends
    reps = tl.arange(0, PACK)
    offs_n = tl.arange(0, BLOCK_N)
    pos = interleaved_channels(D, LOW_BITS, LOW_FLOAT, q.dtype)
    q32 = q.to(tl.float32)
    first = rows < GP
    m_i = tl.where(first, m_i, float("-inf"))
    l_i = tl.where(first, l_i, 0.0)
    acc = tl.where(first[:, None], acc, 0.0)
    for pi in range(p0, p1, PACK):
        live = pi + rep < p1
        page_of = tl.load(table_row + pi + rep, mask=live, other=0).to(tl.int64)  # [ROWS]
        pages = tl.load(table_row + pi + reps, mask=pi + reps < p1, other=0).to(tl.int64)
        # 1. Each row's page's key parameters folded into it: q_s [ROWS, D], bias [ROWS].
        chan = (page_of[:, None] * H_P + j) * D + pos[None, :]
        q_s = (q32 * tl.load(param_ptr(low_row, 1) + chan).to(tl.float32)).to(q.dtype)
        if LOW_FLOAT:
            bias = tl.zeros([ROWS], tl.float32)
        else:
            bias = tl.sum(q32 * tl.load(param_ptr(low_row, 2) + chan).to(tl.float32), 1)
        if OFFSET != 0.0:
            bias -= OFFSET * tl.sum(q_s.to(tl.float32), 1)
        shift = tl.zeros([ROWS], tl.float32)
        # 2. The pages' low slots, BLOCK_N of each page a step.
        for s0 in range(0, lo_g, BLOCK_N):
            slot = s0 + offs_n
            valid = slot < lo_g
            logits = tl.full([ROWS, BLOCK_N], float("-inf"), tl.float32)
            for r in tl.static_range(PACK):
                k, ok = _step_codes(low_row, 0, table_row, pi + r, p1, slot, valid, lo_g, j,
                                    H_P, D, LOW_BITS, LOW_FLOAT, NATIVE, q.dtype)
                logits = tl.where((rep == r)[:, None] & ok[None, :],
                                  mma(q_s, tl.trans(k), PRECISION), logits)
            logits = (logits + bias[:, None]) * scale
            # The value parameters of the PACK pages' tiles [PACK, BLOCK_N], repeated for
            # each page's rows [ROWS, BLOCK_N].
            seen = (pi + reps < p1)[:, None] & valid[None, :]
            tok_p = (pages[:, None] * lo_g + slot[None, :]) * H_P + j
            v_scale = _rows_of(tl.load(param_ptr(low_row, 4) + tok_p, mask=seen,
                                       other=0.0).to(tl.float32), GP)
            if LOW_FLOAT:
                v_zero = tl.zeros([ROWS, BLOCK_N], tl.float32)
            else:
                v_zero = _rows_of(tl.load(param_ptr(low_row, 5) + tok_p, mask=seen,
                                          other=0.0).to(tl.float32), GP)
            m_new, alpha, l_i, p_s, shift = _folded_probs(logits, v_scale, v_zero, m_i, l_i,
                                                          shift, OFFSET, q.dtype)
            acc = rescaled(acc, alpha, m_new > m_i)
            for r in tl.static_range(PACK):
                v, _ = _step_codes(low_row, 3, table_row, pi + r, p1, slot, valid, lo_g, j, H_P,
                                   D, LOW_BITS, LOW_FLOAT, NATIVE, q.dtype)
                acc += mma(tl.where((rep == r)[:, None], p_s, 0.0).to(q.dtype), v, PRECISION)
            m_i = m_new
        acc += shift[:, None]
    # 3. Each head's PACK softmaxes merged, into every repeat of its row.
    m3 = tl.reshape(m_i, [PACK, GP])
    m_max = tl.max(m3, 0)
    w = tl.exp(m3 - tl.where(m_max == float("-inf"), 0.0, m_max)[None, :])  # [PACK, GP]
    l_sum = tl.sum(tl.reshape(l_i, [PACK, GP]) * w, 0)
    a_sum = tl.sum(tl.reshape(acc, [PACK, GP, D]) * w[:, :, None], 0)
    m_i = tl.reshape(tl.broadcast_to(m_max[None, :], [PACK, GP]), [ROWS])
    l_i = tl.reshape(tl.broadcast_to(l_sum[None, :], [PACK, GP]), [ROWS])
    acc = tl.reshape(tl.broadcast_to(a_sum[None, :, :], [PACK, GP, D]), [ROWS, D])
    return m_i, l_i, acc


@triton.jit
def _step_codes(low_row, i: tl.constexpr, table_row, pi, p1, slot, valid, lo_g, j,
                H_P: tl.constexpr, D: tl.constexpr, LOW_BITS: tl.constexpr,
                LOW_FLOAT: tl.constexpr, NATIVE: tl.constexpr, DOT: tl.constexpr):
    """The codes of slots `slot` of page table_row[pi] (absent past p1) of member head j, from
    low_row's code tensor i (0 keys, 3 values), as low_codes gives them [BLOCK_N, D], and
    which of them are there (ok [BLOCK_N])."""
    CB: tl.constexpr = D * LOW_BITS // 8
    has = pi < p1
    page = tl.load(table_row + pi, mask=has, other=0).to(tl.int64)
    ok = valid & has
    tok = (page * lo_g + slot) * H_P + j
    packed = tl.load(code_ptr(low_row, i) + tok[:, None] * CB + tl.arange(0, CB)[None, :],
                     mask=ok[:, None], other=0)
    return low_codes(packed, slot.shape[0], D, LOW_BITS, LOW_FLOAT, NATIVE, DOT), ok


@triton.jit
def _rows_of(x, GP: tl.constexpr):
    """x [PACK, N] as [PACK * GP, N]: row r repeated GP times (a packed program's rows)."""
    PACK: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, None, :], [PACK, GP, N]), [PACK * GP, N])


@triton.jit
def _plane_of(x, p: tl.constexpr, P: tl.constexpr):
    """Channels [p CB, (p + 1) CB) of x [R, D] (CB = D / P) as [R, CB] float32: a masked sum
    over x's P planes (exact: the others add zeros), no join."""
    R: tl.constexpr = x.shape[0]
    CB: tl.constexpr = x.shape[1] // P
    x3 = tl.reshape(x.to(tl.float32), [R, P, CB])
    return tl.sum(tl.where((tl.arange(0, P) == p)[None, :, None], x3, 0.0), 1)


@triton.jit
def _from_planes(a0, a1, a2, a3, P: tl.constexpr):
    """x [R, P CB] float32 from its planes [R, CB] (`_plane_of`'s inverse; a2 and a3 are read
    only when P is 4)."""
    R: tl.constexpr = a0.shape[0]
    CB: tl.constexpr = a0.shape[1]
    idx = tl.arange(0, P)[None, :, None]
    x3 = tl.where(idx == 0, a0[:, None, :], 0.0) + tl.where(idx == 1, a1[:, None, :], 0.0)
    if P == 4:
        x3 += tl.where(idx == 2, a2[:, None, :], 0.0) + tl.where(idx == 3, a3[:, None, :], 0.0)
    return tl.reshape(x3, [R, P * CB])


@triton.jit
def _attend_code_pages(q, m_i, l_i, acc, low_row, table_row, p0, p1, lo_g, j, scale,
                       H_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, LOW_BITS: tl.constexpr, NATIVE: tl.constexpr):
    """Pages table_row[p0:p1] of a 2- or 4-bit integer tier (low_row: its six addresses; lo_g
    slots a page) of member head j, one dot per bit plane: plane p of the packed codes holds
    channels [p CB, (p + 1) CB), so with q and acc cut into the same channel ranges once per
    call, logits = sum_p (q_p * s_p) . codes_p + q . z and acc_p += (p * s_v) codes_p, each dot
    on a plane straight from the bytes (quant.code_planes), none on joined planes. The
    arithmetic is `_attend_low_page`'s (code_offset included): only the order of the sums over
    channels differs. Needs CB = D * bits / 8 >= 16 (a dot's smallest side)."""
    P: tl.constexpr = 8 // LOW_BITS
    CB: tl.constexpr = D // P
    OFFSET: tl.constexpr = code_offset(LOW_BITS, False, q.dtype)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CB)
    q0, q1 = _plane_of(q, 0, P), _plane_of(q, 1, P)
    a0, a1 = _plane_of(acc, 0, P), _plane_of(acc, 1, P)
    if P == 4:
        q2, q3 = _plane_of(q, 2, P), _plane_of(q, 3, P)
        a2, a3 = _plane_of(acc, 2, P), _plane_of(acc, 3, P)
    else:
        q2, q3, a2, a3 = q0, q1, a0, a1  # unread
    for pi in range(p0, p1):
        page = tl.load(table_row + pi).to(tl.int64)
        chan = (page * H_P + j) * D + offs_c
        s_k, z_k = param_ptr(low_row, 1) + chan, param_ptr(low_row, 2) + chan
        # The page's key parameters folded into the query planes: qs_p [ROWS, CB], bias [ROWS].
        qs0 = (q0 * tl.load(s_k).to(tl.float32)[None, :]).to(q.dtype)
        qs1 = (q1 * tl.load(s_k + CB).to(tl.float32)[None, :]).to(q.dtype)
        bias = (tl.sum(q0 * tl.load(z_k).to(tl.float32)[None, :], 1)
                + tl.sum(q1 * tl.load(z_k + CB).to(tl.float32)[None, :], 1))
        if P == 4:
            qs2 = (q2 * tl.load(s_k + 2 * CB).to(tl.float32)[None, :]).to(q.dtype)
            qs3 = (q3 * tl.load(s_k + 3 * CB).to(tl.float32)[None, :]).to(q.dtype)
            bias += (tl.sum(q2 * tl.load(z_k + 2 * CB).to(tl.float32)[None, :], 1)
                     + tl.sum(q3 * tl.load(z_k + 3 * CB).to(tl.float32)[None, :], 1))
        else:
            qs2, qs3 = qs0, qs1  # unread
        if OFFSET != 0.0:
            q_sum = tl.sum(qs0.to(tl.float32), 1) + tl.sum(qs1.to(tl.float32), 1)
            if P == 4:
                q_sum += tl.sum(qs2.to(tl.float32), 1) + tl.sum(qs3.to(tl.float32), 1)
            bias -= OFFSET * q_sum
        shift = tl.zeros([q.shape[0]], tl.float32)
        for s0 in range(0, lo_g, BLOCK_N):
            slot = s0 + offs_n
            valid = slot < lo_g
            tok = (page * lo_g + slot) * H_P + j
            byte = tok[:, None] * CB + offs_c[None, :]
            k0, k1, k2, k3 = code_planes(
                tl.load(code_ptr(low_row, 0) + byte, mask=valid[:, None], other=0), LOW_BITS,
                q.dtype, NATIVE)
            logits = mma(qs0, tl.trans(k0), PRECISION) + mma(qs1, tl.trans(k1), PRECISION)
            if P == 4:
                logits += mma(qs2, tl.trans(k2), PRECISION) + mma(qs3, tl.trans(k3), PRECISION)
            logits = tl.where(valid[None, :], (logits + bias[:, None]) * scale, float("-inf"))
            v0, v1, v2, v3 = code_planes(
                tl.load(code_ptr(low_row, 3) + byte, mask=valid[:, None], other=0), LOW_BITS,
                q.dtype, NATIVE)
            v_scale = tl.load(param_ptr(low_row, 4) + tok, mask=valid, other=0.0).to(tl.float32)
            v_zero = tl.load(param_ptr(low_row, 5) + tok, mask=valid, other=0.0).to(tl.float32)
            m_new, alpha, l_i, p_s, shift = _folded_probs(logits, v_scale[None, :],
                                                          v_zero[None, :], m_i, l_i, shift,
                                                          OFFSET, q.dtype)
            grew = m_new > m_i
            a0 = rescaled(a0, alpha, grew) + mma(p_s, v0, PRECISION)
            a1 = rescaled(a1, alpha, grew) + mma(p_s, v1, PRECISION)
            if P == 4:
                a2 = rescaled(a2, alpha, grew) + mma(p_s, v2, PRECISION)
                a3 = rescaled(a3, alpha, grew) + mma(p_s, v3, PRECISION)
            m_i = m_new
        a0, a1 = a0 + shift[:, None], a1 + shift[:, None]
        if P == 4:
            a2, a3 = a2 + shift[:, None], a3 + shift[:, None]
    return m_i, l_i, _from_planes(a0, a1, a2, a3, P)


@triton.jit
def _softmax_step_folded(logits, codes, v_scale, v_zero, m_i, l_i, acc, shift,
                         PRECISION: tl.constexpr, OFFSET: tl.constexpr):
    """softmax_step for values stored as codes [BLOCK_N, BLOCK_D] (each plus OFFSET,
    quant.code_offset) with per-token scale and zero [BLOCK_N] float32: the probabilities take
    the scales; the zeros' term (less OFFSET times the scaled probabilities), the same for
    every channel, accumulates in shift [ROWS] beside acc (acc + shift[:, None] is the
    output's numerator)."""
    m_new, alpha, l_i, p_s, shift = _folded_probs(logits, v_scale[None, :], v_zero[None, :],
                                                  m_i, l_i, shift, OFFSET, codes.dtype)
    acc = rescaled(acc, alpha, m_new > m_i) + mma(p_s, codes, PRECISION)
    return m_new, l_i, acc, shift


@triton.jit
def _folded_probs(logits, v_scale, v_zero, m_i, l_i, shift, OFFSET: tl.constexpr,
                  DOT: tl.constexpr):
    """The online-softmax step of values stored as codes, before the values' dot: the new
    running max, the rescale alpha, the normalizer, the probabilities with the value scales
    folded in (p_s [ROWS, BLOCK_N] in DOT) and shift with this tile's zero-point term. v_scale
    and v_zero: [1, BLOCK_N] (every row's tokens the same) or [ROWS, BLOCK_N] float32."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(logits - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p_s = (p * v_scale).to(DOT)
    shift = shift * alpha + tl.sum(p * v_zero, 1)
    if OFFSET != 0.0:
        shift -= OFFSET * tl.sum(p_s.to(tl.float32), 1)
    return m_new, alpha, l_i, p_s, shift


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
        logits = mma(q, tl.trans(k), PRECISION) * scale
        visible = (t[None, :] <= lim[:, None]) & (t < t_end)[None, :]
        logits = tl.where(visible, logits, float("-inf"))
        m_i, l_i, acc = softmax_step(logits, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc
