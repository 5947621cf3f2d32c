"""SGLang 0.5.23's own quantized KV caches (``--kv-cache-dtype``), emulated as it stores them.

These are what a GPU user of stock SGLang has instead of sgl-ragged. Each one keeps every token
and quantizes keys and values alike, per token and KV head, with scale blocks that run along
head_dim (read from the installed sglang and flashinfer packages):

    | dtype          | code per element    | block | scale per block                    | bytes/elem  |
    |----------------|---------------------|-------|------------------------------------|-------------|
    | fp8_e4m3       | float8_e4m3fn       | -     | none (per-layer k_scale, 1.0 here) | 1           |
    | mxfp8          | float8_e4m3fn       | 32    | UE8M0 byte: 2^ceil(log2(amax/448)) | 1 + 1/32    |
    | fp4_mx_block16 | E2M1, two per byte  | 16    | UE8M0 byte: 2^ceil(log2(amax/6))   | 1/2 + 1/16  |
    | nvfp4          | E2M1, two per byte  | 16    | E4M3 byte: amax/6/g (g: per layer) | 1/2 + 1/16  |

Rounding, element by element:

- fp8_e4m3 (mem_cache/memory_pool.py ``MHATokenToKVPool.set_kv_buffer``; on CPU
  ``CPUFP8KVCacheMethod``): ``(x / k_scale).to(float8_e4m3fn)``, torch's cast: nearest, ties to
  even, subnormals kept, finite overflow and inf saturate to ±448 (torch 2.14; older torch gave
  NaN from 480 up). A checkpoint without KV scales (ours) has k_scale = v_scale = 1.
- mxfp8 (kernels/ops/kvcache/mxfp8_quant_store_kv.py, the same arithmetic as
  kernels/ops/quantization/mxfp8_quant.py): e = clamp(ceil(log2(max(amax, 1e-30) / 448)) + 127,
  0, 254) per 32 elements, code = e4m3(clamp(x / 2^(e-127), ±448)) (nearest even), read back as
  code * 2^(e-127). A dense model's pool takes it only at page size 128 (the fused store kernel's
  interleaved scale layout), and only FA4 reads it.
- fp4_mx_block16 (layers/quantization/kvfp4_tensor.py ``FP4MXBlock16KVQuantizeUtil``): e =
  ceil(log2(max(amax / 6, 1e-10))) per 16 elements, stored as e + 127; |x| / 2^e rounds to the
  E2M1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} with ties upward (the code counts the midpoints at
  or below it), so it saturates at 6; the sign bit is x / 2^e < 0. Read back as bf16.
- nvfp4 (layers/quantization/kvfp4_tensor.py ``NVFP4KVQuantizeUtil`` -> flashinfer
  ``nvfp4_kv_quantize``, data/csrc/fp4_kv_quantization.cu): s = e4m3(amax * (1/6) / g) per 16
  elements (nearest even, saturating), code = cvt.rn.satfinite E2M1 of x / (s * g) (ties to even,
  saturating at ±6), read back as code * s * g, where g is the layer's k_scale / v_scale from the
  checkpoint (1.0 without); a nonzero block whose s rounds to 0 reads back as 0. The quantize
  kernel needs SM100+. Decode (trtllm_mha) reads the FP4 itself; FlashInfer prefill would read a
  copy dequantized to FP8, which is not modelled here.

All arithmetic is in float32 whatever the input dtype, as the GPU kernels (and torch.compile's
code for fp4_mx_block16) compute it. Two approximations of the CUDA code are not reproduced bit
for bit: nvfp4's ``rcp.approx`` reciprocals (this divides exactly) and the last ulp of log2 near
powers of two (where the clamp to the format's largest value absorbs the difference).

Bytes: a token costs ``bytes_per_token(head_dim, heads)`` per layer, scales included, as SGLang's
pool sizing counts it (``DefaultPoolConfigurator._compute_cell_size``; for nvfp4 with decode and
prefill on trtllm_mha: on SM100 with FlashInfer prefill the pool also keeps a second scale layout
and an FP8 dequant workspace row per token). Per-layer scales (fp8's k_scale, nvfp4's g) cost
nothing per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest E2M1 magnitude
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code & 7; bit 3 is the sign
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
MXFP8_BLOCK = 32
FP4_BLOCK = 16
UE8M0_BIAS = 127


class Quantized(NamedTuple):
    """A [T, H, D] tensor as one of the caches stores it."""

    codes: torch.Tensor  # fp8: float8_e4m3fn [T, H, D]; fp4: uint8 [T, H, D / 2], even element low
    scales: torch.Tensor | None  # per block (layout per format), None for fp8_e4m3


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, H, D] -> float32 [T, H, D / block, block]."""
    t, h, d = x.shape
    if d % block:
        raise ValueError(f"head_dim {d} is not a multiple of the {block}-element scale block")
    return x.float().reshape(t, h, d // block, block)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..., D] -> [..., D / 2], element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 2] -> 4-bit codes uint8 [..., D]."""
    return torch.stack([packed & 0x0F, packed >> 4], -1).flatten(-2)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [...] -> float32 values [...]."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def _midpoints(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_MIDPOINTS, device=device)


def _e2m1_nearest_even(y: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> 4-bit codes uint8 [...]: round to nearest, ties to the even code,
    saturating at ±6 (PTX cvt.rn.satfinite.e2m1x2.f32); NaN gets magnitude 0."""
    a = y.abs().nan_to_num(0.0).clamp(max=E2M1_MAX)
    below = torch.bucketize(a, _midpoints(y.device))  # midpoints strictly below a
    upto = torch.bucketize(a, _midpoints(y.device), right=True)  # midpoints at or below a
    magnitude = torch.where(below % 2 == 0, below, upto)  # differ only on a tie
    sign = torch.signbit(y) & ~torch.isnan(y)
    return (magnitude + sign * 8).to(torch.uint8)


# ---- fp8_e4m3 ------------------------------------------------------------------------------


def fp8_e4m3_quantize(x: torch.Tensor, scale: float = 1.0) -> Quantized:
    """x [T, H, D] -> codes float8_e4m3fn [T, H, D]; ``scale`` is the layer's k_scale/v_scale."""
    return Quantized((x.float() / scale).to(torch.float8_e4m3fn), None)


def fp8_e4m3_dequantize(q: Quantized, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (q.codes.float() * scale).to(dtype)


# ---- mxfp8 ---------------------------------------------------------------------------------


def mxfp8_quantize(x: torch.Tensor) -> Quantized:
    """x [T, H, D] -> codes float8_e4m3fn [T, H, D], scales uint8 [T, H, D / 32] (biased UE8M0)."""
    blocks = _blocks(x, MXFP8_BLOCK)  # [T, H, D/32, 32]
    amax = blocks.abs().amax(-1).clamp_min(1e-30)
    biased = (torch.ceil(torch.log2(amax / FP8_MAX)) + UE8M0_BIAS).clamp(0, 254)
    scaled = (blocks / torch.exp2(biased - UE8M0_BIAS)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return Quantized(scaled.to(torch.float8_e4m3fn).reshape(x.shape), biased.to(torch.uint8))


def mxfp8_dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    assert q.scales is not None
    codes = q.codes.float().reshape(*q.scales.shape, MXFP8_BLOCK)
    scale = torch.exp2(q.scales.float() - UE8M0_BIAS)[..., None]
    return (codes * scale).reshape(q.codes.shape).to(dtype)


# ---- fp4_mx_block16 ------------------------------------------------------------------------


def fp4_mx_block16_quantize(x: torch.Tensor) -> Quantized:
    """x [T, H, D] -> packed E2M1 uint8 [T, H, D / 2], scales uint8 [T, H * D / 16] (biased
    exponents; SGLang's scale buffer flattens heads and head_dim)."""
    blocks = _blocks(x, FP4_BLOCK)  # [T, H, D/16, 16]
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.clamp(amax / E2M1_MAX, min=1e-10)))
    scaled = blocks / torch.exp2(exponent)
    magnitude = torch.bucketize(scaled.abs(), _midpoints(x.device), right=True)  # ties upward
    codes = (magnitude + (scaled < 0) * 8).to(torch.uint8).reshape(x.shape)
    scales = (exponent + UE8M0_BIAS).to(torch.uint8).reshape(x.shape[0], -1)
    return Quantized(_pack(codes), scales)


def fp4_mx_block16_dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    assert q.scales is not None
    values = _e2m1_values(_unpack(q.codes))  # [T, H, D]
    blocks = values.reshape(*q.scales.shape, FP4_BLOCK)
    scale = torch.exp2(q.scales.float() - UE8M0_BIAS)[..., None]
    return (blocks * scale).reshape(values.shape).to(dtype)


# ---- nvfp4 ---------------------------------------------------------------------------------


def nvfp4_quantize(x: torch.Tensor, global_scale: float = 1.0) -> Quantized:
    """x [T, H, D] -> packed E2M1 uint8 [T, H, D / 2], block scales float8_e4m3fn [T, H, D / 16];
    ``global_scale`` is the layer's k_scale / v_scale (x = code * block scale * global)."""
    blocks = _blocks(x, FP4_BLOCK)  # [T, H, D/16, 16]
    amax = blocks.abs().amax(-1)
    scales = ((amax * (1.0 / E2M1_MAX)) * (1.0 / global_scale)).to(torch.float8_e4m3fn)
    # the kernel tests amax, not the scale: a block whose scale rounds to 0 multiplies by inf
    inverse = torch.where(amax != 0, 1.0 / (scales.float() * global_scale), 0.0)
    codes = _e2m1_nearest_even(blocks * inverse[..., None]).reshape(x.shape)
    return Quantized(_pack(codes), scales)


def nvfp4_dequantize(q: Quantized, dtype: torch.dtype, global_scale: float = 1.0) -> torch.Tensor:
    assert q.scales is not None
    values = _e2m1_values(_unpack(q.codes))  # [T, H, D]
    blocks = values.reshape(*q.scales.shape, FP4_BLOCK) * q.scales.float()[..., None]
    return (blocks.reshape(values.shape) * global_scale).to(dtype)


# ---- the formats ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StockFormat:
    """One ``--kv-cache-dtype`` of SGLang: its storage per element and its round trip."""

    name: str
    code_bits: int  # per element
    block: int  # elements per stored scale; 0: no per-token scales
    scale_bits: int  # per block
    quantize: Callable[[torch.Tensor], Quantized]
    dequantize: Callable[[Quantized, torch.dtype], torch.Tensor]

    def bytes_per_token(self, head_dim: int, heads: int) -> int:
        """Bytes of one token's keys and values for ``heads`` KV heads of one layer, scales
        included (SGLang's pool cell size per layer)."""
        if self.block and head_dim % self.block:
            raise ValueError(f"{self.name}: head_dim {head_dim} is not a multiple of {self.block}")
        scales = head_dim // self.block * self.scale_bits // 8 if self.block else 0
        return 2 * heads * (head_dim * self.code_bits // 8 + scales)

    def bytes_fraction(self, head_dim: int) -> float:
        """Bytes per token as a fraction of a bf16 cache's."""
        return self.bytes_per_token(head_dim, 1) / (2 * head_dim * 2)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> [T, H, D] in x's dtype: the values SGLang's attention reads back."""
        return self.dequantize(self.quantize(x), x.dtype)


STOCK_FORMATS: dict[str, StockFormat] = {
    f.name: f
    for f in (
        StockFormat("fp8_e4m3", 8, 0, 0, fp8_e4m3_quantize, fp8_e4m3_dequantize),
        StockFormat("mxfp8", 8, MXFP8_BLOCK, 8, mxfp8_quantize, mxfp8_dequantize),
        StockFormat("fp4_mx_block16", 4, FP4_BLOCK, 8, fp4_mx_block16_quantize,
                    fp4_mx_block16_dequantize),
        StockFormat("nvfp4", 4, FP4_BLOCK, 8, nvfp4_quantize, nvfp4_dequantize),
    )
}  # fmt: skip


def stock_format(name: str) -> StockFormat:
    """The format of ``--kv-cache-dtype name``; a clear error for any other name."""
    if name not in STOCK_FORMATS:
        raise ValueError(f"unknown SGLang KV cache dtype {name!r}: expected one of "
                         f"{list(STOCK_FORMATS)} (SGLang 0.5.23's quantized --kv-cache-dtype values)")
    return STOCK_FORMATS[name]
