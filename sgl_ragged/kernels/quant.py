"""Triton device functions for rows' low tier (mem_pool/quant.py's format, docs/architecture.md, "Row tiers"):
read a block of low-tier codes for attention (attend.py folds the scales and zero points into
the query and the probabilities, so nothing is dequantized), quantize and pack a sealed page's
low tier.

The quantizer reproduces `quant.quantize` bit for bit up to rounding ties of the codes: scale
and zero are rounded to float16 before coding, divisions are correctly rounded (`div_rn`;
Triton's `/` is approximate on a GPU) and codes round half to even like torch.round. fp8
(float8_e4m3fn) codes are encoded with integer arithmetic instead of a `tl.float8e4nv` cast,
and decoded that way under the interpreter only: Triton's interpreter flushes e4m3 subnormals
to zero where torch keeps them (checked with Triton 3.8), so a cast would make the CPU tests
disagree with the torch quantizer; the arithmetic is exact on both.

Low-tier addresses of a group come as a row of LayerTables.low_ptr (tables.LOW_TENSORS order):
0 k_codes [pages, lo, H_p, CB] uint8, 1 k_scale / 2 k_zero [pages, H_p, D] float16, 3 v_codes
[pages, lo, H_p, CB] uint8, 4 v_scale / 5 v_zero [pages, lo, H_p] float16, CB = D * bits / 8.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # quant.FP8_MAX


@triton.jit
def code_ptr(low_row, i):
    """uint8 pointer to the codes tensor in column i of a low_ptr row."""
    return tl.load(low_row + i).to(tl.pointer_type(tl.uint8))


@triton.jit
def param_ptr(low_row, i):
    """float16 pointer to the parameter tensor in column i of a low_ptr row."""
    return tl.load(low_row + i).to(tl.pointer_type(tl.float16))


@triton.jit
def _pow2(e):
    """2.0 ** e as float32 for integer e in [-126, 127], exact (built from its exponent bits)."""
    return ((e + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(y):
    """torch.round of float32 y (ties to even), exact."""
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return r + ((f > 0.5) | ((f == 0.5) & odd)).to(tl.float32)


@triton.jit
def _fp8_decode(code):
    """float32 value of float8_e4m3fn bytes (int32 in [0, 256); NaN codes never stored)."""
    e = (code >> 3) & 15
    mag = ((code & 7) + tl.where(e > 0, 8, 0)).to(tl.float32) * _pow2(tl.maximum(e, 1) - 10)
    return tl.where(code >= 128, -mag, mag)


@triton.jit
def _fp8_encode(y):
    """float8_e4m3fn bytes (int32) of float32 y in [-448, 448], rounded to nearest even like
    torch's cast (subnormals included). A mantissa that rounds up to 16 carries into the
    exponent field by itself."""
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
    code = (e + 6) * 8 + _round_half_even(a * _pow2(3 - e)).to(tl.int32)
    return tl.where(y < 0, code | 128, code)


@triton.jit
def _planes(packed, M: tl.constexpr, LOW_BITS: tl.constexpr, D: tl.constexpr):
    """Codes int32 [M, D] in channel order from the packed bytes [M, CB] int32 that hold them
    (quant.pack's planar order: plane p = channels [p * CB, (p + 1) * CB) at bit offset
    p * bits). Each byte is loaded once; the planes are joined in registers."""
    MASK: tl.constexpr = (1 << LOW_BITS) - 1
    if LOW_BITS == 8:
        codes = packed
    elif LOW_BITS == 4:
        x = tl.join(packed & MASK, (packed >> 4) & MASK)  # [M, CB, 2]: [.., c, p]
        codes = tl.reshape(tl.permute(x, (0, 2, 1)), [M, D])
    else:
        tl.static_assert(LOW_BITS == 2, "low tiers have 8, 4 or 2 bits")
        # [M, CB, 2, 2]: [.., c, i, k] = plane 2k + i
        x = tl.join(tl.join(packed & MASK, (packed >> 2) & MASK),
                    tl.join((packed >> 4) & MASK, (packed >> 6) & MASK))
        codes = tl.reshape(tl.permute(x, (0, 3, 2, 1)), [M, D])
    return codes


@triton.jit
def low_codes(packed, M: tl.constexpr, D: tl.constexpr, LOW_BITS: tl.constexpr,
              LOW_FLOAT: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT: tl.constexpr):
    """The code values [M, D] in DOT (exact there: integers below 256, e4m3 numbers) of packed
    code bytes [M, CB] uint8: a stored low-tier entry before its scale and zero. fp8 converts
    natively on a GPU (NATIVE_FP8), with integer arithmetic under the interpreter."""
    if LOW_FLOAT:
        if NATIVE_FP8:
            values = packed.to(tl.float8e4nv, bitcast=True).to(DOT)
        else:
            values = _fp8_decode(packed.to(tl.int32)).to(DOT)
    else:
        values = _planes(packed.to(tl.int32), M, LOW_BITS, D).to(DOT)
    return values


@triton.jit
def _params(x, sel, AXIS: tl.constexpr, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr):
    """Scale and zero (float16 values, as float32) of x [BLOCK_P, BLOCK_D] float32 over the
    entries sel [BLOCK_P, BLOCK_D] along AXIS (quant._quantize; 0 where nothing is selected)."""
    if LOW_FLOAT:
        amax = tl.max(tl.where(sel, tl.abs(x), 0.0), AXIS)
        scale = tl.math.div_rn(amax, FP8_MAX).to(tl.float16).to(tl.float32)
        return scale, tl.zeros_like(scale)
    lo = tl.min(tl.where(sel, x, float("inf")), AXIS)
    hi = tl.max(tl.where(sel, x, float("-inf")), AXIS)
    some = lo <= hi
    zero = tl.where(some, lo, 0.0).to(tl.float16).to(tl.float32)
    levels = ((1 << LOW_BITS) - 1) * 1.0
    scale = tl.math.div_rn(tl.where(some, hi, 0.0) - zero, levels).to(tl.float16).to(tl.float32)
    return scale, zero


@triton.jit
def _encode(x, scale, zero, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr,
            BLOCK_P: tl.constexpr, D: tl.constexpr):
    """Packed code bytes [BLOCK_P, CB] uint8 of x [BLOCK_P, D] float32 with scale and zero
    broadcastable to it (quant._quantize, then quant.pack)."""
    safe = tl.where(scale > 0, scale, 1.0)
    if LOW_FLOAT:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -FP8_MAX), FP8_MAX)
        return _fp8_encode(y).to(tl.uint8)
    levels = ((1 << LOW_BITS) - 1) * 1.0
    codes = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x - zero, safe)), 0.0), levels)
    PER: tl.constexpr = 8 // LOW_BITS
    CB: tl.constexpr = D // PER
    shift = (tl.arange(0, D) // CB) * LOW_BITS
    shifted = codes.to(tl.int32) << shift[None, :]  # disjoint bit fields: their sum is their OR
    return tl.sum(tl.reshape(shifted, [BLOCK_P, PER, CB]), 1).to(tl.uint8)


@triton.jit
def store_low(x_k, x_v, lo, slot, page, j, lo_g, low_row, H_P: tl.constexpr, D: tl.constexpr,
              BLOCK_P: tl.constexpr, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr):
    """Quantize one (page, head)'s low tier into its rows: x_k, x_v [BLOCK_P, D] float32 the
    page's tokens, lo [BLOCK_P] bool the low-tier ones, slot [BLOCK_P] their low slots; keys
    per channel over the low-tier tokens, values per token. page < 0 writes nothing."""
    CB: tl.constexpr = D * LOW_BITS // 8
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, CB)
    write = lo & (page >= 0)
    sel = lo[:, None] & (offs_d < D)[None, :]
    tok = (page * lo_g + slot) * H_P + j  # [BLOCK_P] (page, slot, head) entries
    # 1. Keys: parameters per channel over the low-tier tokens.
    k_scale, k_zero = _params(x_k, sel, 0, LOW_BITS, LOW_FLOAT)  # [D]
    chan = (page * H_P + j) * D + offs_d
    tl.store(param_ptr(low_row, 1) + chan, k_scale.to(tl.float16), mask=page >= 0)
    if not LOW_FLOAT:
        tl.store(param_ptr(low_row, 2) + chan, k_zero.to(tl.float16), mask=page >= 0)
    k_codes = _encode(x_k, k_scale[None, :], k_zero[None, :], LOW_BITS, LOW_FLOAT, BLOCK_P, D)
    byte = tok[:, None] * CB + offs_c[None, :]
    tl.store(code_ptr(low_row, 0) + byte, k_codes, mask=write[:, None])
    # 2. Values: parameters per token.
    v_scale, v_zero = _params(x_v, sel, 1, LOW_BITS, LOW_FLOAT)  # [BLOCK_P]
    tl.store(param_ptr(low_row, 4) + tok, v_scale.to(tl.float16), mask=write)
    if not LOW_FLOAT:
        tl.store(param_ptr(low_row, 5) + tok, v_zero.to(tl.float16), mask=write)
    v_codes = _encode(x_v, v_scale[:, None], v_zero[:, None], LOW_BITS, LOW_FLOAT, BLOCK_P, D)
    tl.store(code_ptr(low_row, 3) + byte, v_codes, mask=write[:, None])
