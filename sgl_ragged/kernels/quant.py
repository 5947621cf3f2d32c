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
def table_ptr(addr, DTYPE: tl.constexpr):
    """The DTYPE pointer whose address is stored at `addr` (an int64 of LayerTables), 16-byte
    aligned (tables.ADDRESS_ALIGN, checked where the tables are built). Triton knows nothing of
    an address cast from an integer, so without the hint every load through it is one element
    wide: LDG.E.U16 for bfloat16 rows, LDG.E.U8 for codes, where 16-byte loads (LDG.E.128) are
    possible (bench.kernel_resources counts them). The hint must be on the pointer: on the
    int64 it is lost in the cast."""
    return tl.multiple_of(tl.load(addr).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def code_ptr(low_row, i):
    """uint8 pointer to the codes tensor in column i of a low_ptr row."""
    return table_ptr(low_row + i, tl.uint8)


@triton.jit
def param_ptr(low_row, i):
    """float16 pointer to the parameter tensor in column i of a low_ptr row."""
    return table_ptr(low_row + i, tl.float16)


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


_MAGIC = {tl.bfloat16: (128.0, 0x4300), tl.float16: (1024.0, 0x6400)}
"""16-bit DOT -> (2^m, its bits), m the stored mantissa bits: code | bits is the DOT number
2^m + code for a code below 2^m."""


def _unpack_asm(bits: int, magic: int) -> str:
    """PTX for tl.inline_asm_elementwise(pack=4): one 32-bit register of 4 code bytes in, each
    of its 8 // bits bit planes out as 4 16-bit numbers (2 registers a plane, plane p's
    outputs 2p and 2p + 1) whose bits are code | magic. Per 4 bytes: 2 byte permutes, then per
    plane a shift (none for plane 0) and one logical op per output register: about one
    instruction per code, against 3-4 (byte extract, mask, or, 16-bit pack) for the same
    operations written on Triton's 16-bit integers."""
    planes, mask = 8 // bits, (1 << bits) - 1
    n_out = 2 * planes
    lines = ["{", ".reg .b32 lo, hi, t;",
             f"prmt.b32 lo, ${n_out}, 0, 0x4140;",  # bytes 0, 1 -> 16-bit lanes
             f"prmt.b32 hi, ${n_out}, 0, 0x4342;"]  # bytes 2, 3
    lut = 0xEA  # (a & b) | c
    for p in range(planes):
        for half, src in ((0, "lo"), (1, "hi")):
            if p:
                lines.append(f"shr.u32 t, {src}, {p * bits};")
                src = "t"
            lines.append(f"lop3.b32 ${2 * p + half}, {src}, {mask * 0x10001}, {magic * 0x10001}, "
                         f"{lut};")
    return "\n".join(lines + ["}"])


_ASM_INT4_BF16, _ASM_INT4_FP16 = (tl.constexpr(_unpack_asm(4, _MAGIC[dt][1]))
                                  for dt in (tl.bfloat16, tl.float16))
_ASM_INT2_BF16, _ASM_INT2_FP16 = (tl.constexpr(_unpack_asm(2, _MAGIC[dt][1]))
                                  for dt in (tl.bfloat16, tl.float16))


@triton.jit
def _plane(packed, p: tl.constexpr, LOW_BITS: tl.constexpr, MAGIC: tl.constexpr,
           DOT: tl.constexpr):
    """Bit plane p of packed code bytes [M, CB] int16 as DOT numbers code | MAGIC (Triton ops:
    the interpreter's path and the reference of the PTX one)."""
    return ((packed >> (p * LOW_BITS)) & ((1 << LOW_BITS) - 1) | MAGIC).to(DOT, bitcast=True)


@triton.jit
def _ptx_planes(packed, LOW_BITS: tl.constexpr, DOT: tl.constexpr):
    """The bit planes of packed code bytes [M, CB] uint8 as DOT numbers code | MAGIC (MAGIC the
    bits of code_offset), unpacked by `_unpack_asm`: a tuple of 8 // LOW_BITS [M, CB] tensors.
    (Its dtypes must be written out: a dtype passed in as a constexpr does not build.)"""
    if LOW_BITS == 4:
        if DOT == tl.bfloat16:
            planes = tl.inline_asm_elementwise(_ASM_INT4_BF16, "=r,=r,=r,=r,r", [packed],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                               pack=4)
        else:
            planes = tl.inline_asm_elementwise(_ASM_INT4_FP16, "=r,=r,=r,=r,r", [packed],
                                               dtype=(tl.float16, tl.float16), is_pure=True,
                                               pack=4)
    else:
        if DOT == tl.bfloat16:
            planes = tl.inline_asm_elementwise(
                _ASM_INT2_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            planes = tl.inline_asm_elementwise(
                _ASM_INT2_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    return planes


@triton.jit
def _int_planes(packed, M: tl.constexpr, D: tl.constexpr, LOW_BITS: tl.constexpr,
                MAGIC: tl.constexpr, DOT: tl.constexpr, PTX: tl.constexpr):
    """Codes | MAGIC as DOT numbers [M, D] in interleaved channel order (`interleaved`) from
    the packed bytes [M, CB] uint8 that hold them (quant.pack's planar order: plane p =
    channels [p * CB, (p + 1) * CB) at bit offset p * bits). The planes are joined where they
    lie, with no permute: one byte's codes are neighbours. PTX: unpacked by `_ptx_planes`."""
    if LOW_BITS == 4:
        if PTX:
            p0, p1 = _ptx_planes(packed, 4, DOT)
        else:
            x = packed.to(tl.int16)
            p0, p1 = _plane(x, 0, 4, MAGIC, DOT), _plane(x, 1, 4, MAGIC, DOT)
        codes = tl.reshape(tl.join(p0, p1), [M, D])
    else:
        tl.static_assert(LOW_BITS == 2, "packed integer planes have 4 or 2 bits")
        if PTX:
            p0, p1, p2, p3 = _ptx_planes(packed, 2, DOT)
        else:
            x = packed.to(tl.int16)
            p0, p1 = _plane(x, 0, 2, MAGIC, DOT), _plane(x, 1, 2, MAGIC, DOT)
            p2, p3 = _plane(x, 2, 2, MAGIC, DOT), _plane(x, 3, 2, MAGIC, DOT)
        # [M, CB, 2, 2]: [.., c, i, k] = plane 2k + i
        codes = tl.reshape(tl.join(tl.join(p0, p1), tl.join(p2, p3)), [M, D])
    return codes


@triton.jit
def code_planes(packed, LOW_BITS: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr):
    """The bit planes of packed 2- or 4-bit code bytes [M, CB] uint8 apart, as DOT [M, CB]
    tensors: plane p holds channels [p CB, (p + 1) CB) (quant.pack's planar order), each code
    plus code_offset(...). Always 4 tensors: with 4 bits planes 0 and 1, then the same two
    again (unused; the split-planes path, attend._attend_code_pages, reads P of them). No join:
    each plane goes into its own dot."""
    OFFSET: tl.constexpr = code_offset(LOW_BITS, False, DOT)
    MASK: tl.constexpr = (1 << LOW_BITS) - 1
    if OFFSET != 0.0 and NATIVE == 2:
        if LOW_BITS == 4:
            p0, p1 = _ptx_planes(packed, 4, DOT)
            p2, p3 = p0, p1
        else:
            p0, p1, p2, p3 = _ptx_planes(packed, 2, DOT)
    elif OFFSET != 0.0:
        x = packed.to(tl.int16)
        p0, p1 = _plane(x, 0, LOW_BITS, _offset_bits(DOT), DOT), _plane(x, 1, LOW_BITS, _offset_bits(DOT), DOT)
        if LOW_BITS == 4:
            p2, p3 = p0, p1
        else:
            p2 = _plane(x, 2, 2, _offset_bits(DOT), DOT)
            p3 = _plane(x, 3, 2, _offset_bits(DOT), DOT)
    else:
        # Through float32: the interpreter's int-to-bfloat16 cast is a bit cast.
        x = packed.to(tl.int32)
        p0 = (x & MASK).to(tl.float32).to(DOT)
        p1 = ((x >> LOW_BITS) & MASK).to(tl.float32).to(DOT)
        if LOW_BITS == 4:
            p2, p3 = p0, p1
        else:
            p2 = ((x >> 4) & MASK).to(tl.float32).to(DOT)
            p3 = ((x >> 6) & MASK).to(tl.float32).to(DOT)
    return p0, p1, p2, p3


@triton.constexpr_function
def split_planes(planes: bool, bits: int, is_float: bool) -> bool:
    """Whether a tier of `bits`-bit codes is attended plane by plane (attend._attend_code_pages)
    in a launch with PLANES (launch.split_planes): 2- and 4-bit integer codes."""
    return bool(planes) and not is_float and bits in (2, 4)


@triton.jit
def interleaved(x, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr, DOT: tl.constexpr):
    """x [R, D] (channels in order) in the channel order of `low_codes`' values for this tier:
    channel p * CB + c at position c * P + r(p) (P = 8 // bits planes; r(p) = p for 4 bits,
    2 (p % 2) + p // 2 for 2) where the codes are joined unpermuted, else unchanged. Applied
    to a query its dot with the codes is unchanged; `planar` undoes it."""
    if code_offset(LOW_BITS, LOW_FLOAT, DOT) == 0.0:
        return x
    elif LOW_BITS == 4:
        return tl.reshape(tl.permute(tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)),
                          [x.shape[0], x.shape[1]])
    else:
        return tl.reshape(tl.permute(tl.reshape(x, [x.shape[0], 2, 2, x.shape[1] // 4]),
                                     (0, 3, 2, 1)), [x.shape[0], x.shape[1]])


@triton.jit
def interleaved_channels(D: tl.constexpr, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr,
                         DOT: tl.constexpr):
    """[D] int32: the channel at each position of `interleaved`'s order (arange where that is
    the identity), for loading per-channel parameters straight into it."""
    pos = tl.arange(0, D)
    if code_offset(LOW_BITS, LOW_FLOAT, DOT) == 0.0:
        chan = pos
    elif LOW_BITS == 4:
        chan = (pos % 2) * (D // 2) + pos // 2
    else:
        chan = (2 * (pos % 2) + (pos // 2) % 2) * (D // 4) + pos // 4
    return chan


@triton.jit
def planar(x, LOW_BITS: tl.constexpr, LOW_FLOAT: tl.constexpr, DOT: tl.constexpr):
    """The inverse of `interleaved`: x [R, D] in `low_codes`' channel order back in order."""
    if code_offset(LOW_BITS, LOW_FLOAT, DOT) == 0.0:
        return x
    elif LOW_BITS == 4:
        return tl.reshape(tl.permute(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]), (0, 2, 1)),
                          [x.shape[0], x.shape[1]])
    else:
        return tl.reshape(tl.permute(tl.reshape(x, [x.shape[0], x.shape[1] // 4, 2, 2]),
                                     (0, 3, 2, 1)), [x.shape[0], x.shape[1]])


@triton.jit
def _planes(packed, M: tl.constexpr, LOW_BITS: tl.constexpr, D: tl.constexpr):
    """Codes int32 [M, D] in channel order from the packed bytes [M, CB] int32 that hold them
    (quant.pack's planar order). Each byte is loaded once; the planes are joined in
    registers."""
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


@triton.constexpr_function
def code_offset(bits: int, is_float: bool, dot: tl.dtype) -> float:
    """What `low_codes` adds to every code value in DOT: 2^m (m: DOT's stored mantissa bits)
    where a code fits below it, so a code is made a DOT number by setting its bits under that
    power's exponent (logical ops, no int-to-float conversion: those run at a quarter of the
    float rate on an H100, one per code); 0 where the codes are converted. A constexpr in the
    kernels (a @triton.jit function's result is a tensor in Triton 3.6, the devices' version);
    callable on the host too (launch.native_level)."""
    if is_float or bits >= 8 or dot not in _MAGIC:
        return 0.0
    return _MAGIC[dot][0]


@triton.constexpr_function
def _offset_bits(dot: tl.dtype) -> int:
    """The bits of code_offset's 2^m in DOT (a 16-bit type)."""
    return _MAGIC[dot][1]


@triton.jit
def low_codes(packed, M: tl.constexpr, D: tl.constexpr, LOW_BITS: tl.constexpr,
              LOW_FLOAT: tl.constexpr, NATIVE: tl.constexpr, DOT: tl.constexpr):
    """The code values [M, D] in DOT of packed code bytes [M, CB] uint8, each plus
    code_offset(...) (exact: integers below 256 and 2- and 4-bit codes plus 128 in bf16, plus
    1024 in fp16; e4m3 numbers), in `interleaved` channel order: a stored low-tier entry before its scale and zero. NATIVE
    (launch.native_level): 0 in the interpreter, which decodes fp8 with integer arithmetic; 1
    on a GPU, fp8 converted natively; 2 also integer planes unpacked in PTX."""
    if LOW_FLOAT:
        if NATIVE:
            values = packed.to(tl.float8e4nv, bitcast=True).to(DOT)
        else:
            values = _fp8_decode(packed.to(tl.int32)).to(DOT)
    elif code_offset(LOW_BITS, LOW_FLOAT, DOT) != 0.0:
        values = _int_planes(packed, M, D, LOW_BITS, _offset_bits(DOT), DOT, NATIVE == 2)
    else:
        # Through float32: the interpreter's int-to-bfloat16 cast is a bit cast.
        values = _planes(packed.to(tl.int32), M, LOW_BITS, D).to(tl.float32).to(DOT)
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
