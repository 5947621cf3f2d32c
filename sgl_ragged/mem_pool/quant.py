"""Low-precision tier of a ragged row: KIVI-style quantization of one page's kept tokens.

docs/architecture.md, "Row tiers". A group's row may hold, besides its high tier (tokens at the model dtype),
a low tier of `lo` tokens per page stored as codes plus their quantization parameters:

    | tensor   | shape                         | dtype   | meaning                              |
    |----------|-------------------------------|---------|--------------------------------------|
    | k_codes  | [pages, lo, H_p, D * b / 8]   | uint8   | keys, quantized per channel          |
    | k_scale  | [pages, H_p, D]               | float16 | per channel, over the page's lo tokens|
    | k_zero   | [pages, H_p, D]               | float16 | (int formats only)                   |
    | v_codes  | [pages, lo, H_p, D * b / 8]   | uint8   | values, quantized per token          |
    | v_scale  | [pages, lo, H_p]              | float16 | per (token, head)                    |
    | v_zero   | [pages, lo, H_p]              | float16 | (int formats only)                   |

Integer formats are asymmetric: code = round((x - zero) / scale) in [0, 2^b - 1], x' = code *
scale + zero, with scale and zero rounded to float16 before coding (so x' is what a reader of
the stored row computes). `fp8` is symmetric: code = float8_e4m3fn(x / scale), scale = amax /
448. Codes of b < 8 bits are packed planar: byte i of a token holds channels i, i + D*b/8, ...
at bit offsets 0, b, 2b, ..., so unpacking is a few shifts and one concatenation.

On the CPU, where the native kernels are built (sgl_ragged/native), `quantize` runs their
`quantize_low` (cuda_ext/quantize.cpp): the same bits in one call per tensor instead of about 15
small torch ops (sealing a prefill chunk quantizes every group of every layer).
tests/unit/test_quant.py holds the two to equal bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from sgl_ragged.precision import LowPrecision

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class QuantTier:
    """Quantized K and V of a set of pages' low tiers (shapes in the module table)."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor | None
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor | None

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        """The six tensors in declaration order (k_codes, k_scale, k_zero, v_codes, v_scale,
        v_zero), None where the format stores no zero points."""
        return (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.fields() if t is not None]


def native_fields(tier: QuantTier | None) -> list[torch.Tensor]:
    """The six tensors of a group's tier as the native kernels take them (cuda_ext's attend and
    seal_rows): an empty tensor where the group has no such tier or its format no zero points."""
    empty = torch.empty(0, dtype=torch.uint8)
    return [empty if t is None else t for t in (tier.fields() if tier is not None else (None,) * 6)]


def empty_tier(fmt: LowPrecision, pages: int, tokens: int, heads: int, head_dim: int,
               device: torch.device | str) -> QuantTier:
    """Zeroed storage for `pages` pages of a `tokens`-token low tier."""

    def zeros(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    cb = fmt.code_bytes(head_dim)
    return QuantTier(
        k_codes=zeros(pages, tokens, heads, cb, dtype=torch.uint8),
        k_scale=zeros(pages, heads, head_dim),
        k_zero=zeros(pages, heads, head_dim) if fmt.has_zero else None,
        v_codes=zeros(pages, tokens, heads, cb, dtype=torch.uint8),
        v_scale=zeros(pages, tokens, heads),
        v_zero=zeros(pages, tokens, heads) if fmt.has_zero else None,
    )


def quantize(fmt: LowPrecision, k: torch.Tensor, v: torch.Tensor) -> QuantTier:
    """Quantize pages' low tiers: k, v [N, T, H, D] (T tokens of each page) -> QuantTier.

    Keys per channel over the T tokens of each (page, head); values per (token, head)."""
    quantize_one = _quantizer(k.device)
    k_codes, k_scale, k_zero = quantize_one(fmt, k.float(), dim=1)
    v_codes, v_scale, v_zero = quantize_one(fmt, v.float(), dim=3)
    return QuantTier(k_codes, k_scale.squeeze(1), None if k_zero is None else k_zero.squeeze(1),
                     v_codes, v_scale.squeeze(3), None if v_zero is None else v_zero.squeeze(3))


def dequantize(fmt: LowPrecision, tier: QuantTier, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [N, T, H, D] in `dtype` from a QuantTier of N pages."""
    k = _decode(fmt, tier.k_codes, tier.k_scale[:, None], _unsqueeze(tier.k_zero, 1))
    v = _decode(fmt, tier.v_codes, tier.v_scale[..., None], _unsqueeze(tier.v_zero, 3))
    return k.to(dtype), v.to(dtype)


def _unsqueeze(x: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    return None if x is None else x.unsqueeze(dim)


Quantizer = Callable[[LowPrecision, torch.Tensor, int],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _quantizer(device: torch.device) -> Quantizer:
    """The native kernels' quantizer on the CPU where they are built, else torch's."""
    module = native_kernels() if device.type == "cpu" else None
    return _quantize if module is None else functools.partial(_native_quantize, module)


@functools.cache
def native_kernels() -> ModuleType | None:
    """The built native kernels, or None (not built: never builds them from here); the
    quantizer and the storage's row writer (storage.py) run them on the CPU."""
    from sgl_ragged import native

    if not native.is_built():
        return None
    try:
        return native.load()
    except native.NativeUnavailableError:
        return None


def _native_quantize(module: ModuleType, fmt: LowPrecision, x: torch.Tensor, dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_quantize` (x float32 [N, T, H, D], dim 1 or 3) by cuda_ext/quantize.cpp."""
    codes, scale, zero = module.quantize_low(x.contiguous(), fmt.bits, fmt.is_float, dim == 1)
    return codes, scale.unsqueeze(dim), None if fmt.is_float else zero.unsqueeze(dim)


def _quantize(fmt: LowPrecision, x: torch.Tensor, dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x float32 [N, T, H, D], parameters shared along `dim` (kept as size 1).
    Returns packed codes uint8 [N, T, H, D * b / 8], scale and zero float16."""
    if fmt.is_float:
        scale = _divide(x.abs().amax(dim, keepdim=True), FP8_MAX).half()
        safe = torch.where(scale > 0, scale.float(), 1.0)
        codes = (x / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return codes, scale, None
    levels = 2**fmt.bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.half()
    scale = _divide(hi - zero.float(), levels).half()
    safe = torch.where(scale > 0, scale.float(), 1.0)
    codes = torch.round((x - zero.float()) / safe).clamp_(0, levels).to(torch.uint8)
    return pack(codes, fmt.bits), scale, zero


def _divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor correctly rounded, as the kernels divide (div_rn, quant.cpp). On CUDA torch
    multiplies by the reciprocal when the divisor is a Python number, which is off by an ulp
    now and then (two float16 scales of 65536 on an H100, session 18); a divisor tensor on
    x's device (a fill, no copy: capturable) is divided element by element."""
    return x / x.new_full((), float(divisor))


def _decode(fmt: LowPrecision, codes: torch.Tensor, scale: torch.Tensor,
            zero: torch.Tensor | None) -> torch.Tensor:
    """float32 values from packed codes and broadcastable float16 parameters."""
    if fmt.is_float:
        return codes.view(torch.float8_e4m3fn).float() * scale.float()
    return unpack(codes, fmt.bits).float() * scale.float() + zero.float()


def codes_into(fmt: LowPrecision, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Code values of packed uint8 codes [..., D * b / 8] written into `out` [..., D] (a float
    tensor or view of any layout): integer codes as 0 .. 2^b - 1, fp8 codes as their
    float8_e4m3fn values; the quantization parameters are not applied (readers fold them,
    docs/architecture.md, "Row tiers")."""
    per = 8 // fmt.bits
    code_planes_into(fmt, packed, out.unflatten(-1, (per, -1)).movedim(-2, 0))
    return out


def code_planes_into(fmt: LowPrecision, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """codes_into by plane: out [8 / b, ..., D * b / 8], plane j = channels [j * D * b / 8,
    (j + 1) * D * b / 8) (the planar packing's order); each plane is one converting copy, which
    is cheapest when out[j] is contiguous."""
    if fmt.is_float:
        out[0].copy_(packed.view(torch.float8_e4m3fn))
        return out
    per, mask = 8 // fmt.bits, 2**fmt.bits - 1
    for j in range(per):
        plane = packed if j == 0 else packed >> (j * fmt.bits)
        out[j].copy_(plane & mask if j < per - 1 else plane)
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] of `bits` bits -> [..., D * bits / 8], planar (module docstring)."""
    per = 8 // bits
    if per == 1:
        return codes
    parts = codes.chunk(per, dim=-1)  # part j: channels [j * D/per, (j + 1) * D/per)
    out = parts[0].clone()
    for j in range(1, per):
        out |= parts[j] << (j * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: uint8 [..., D * bits / 8] -> uint8 codes [..., D]."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = 2**bits - 1
    return torch.cat([(packed >> (j * bits)) & mask for j in range(per)], dim=-1)
