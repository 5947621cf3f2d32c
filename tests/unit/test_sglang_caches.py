"""SGLang 0.5.23's quantized KV caches (emulator/sglang_caches.py) pinned against SGLang itself.

- fp8_e4m3: against SGLang's CPU FP8 cache method (``CPUFP8KVCacheMethod.quantize_and_store``,
  byte for byte) and against a brute-force e4m3 rounding written out element by element.
- fp4_mx_block16: against SGLang's own ``FP4MXBlock16KVCacheMethod`` store and read (its
  torch.compile'd quantizer runs on the CPU), codes and scales byte for byte, float32 and bf16.
- mxfp8: SGLang quantizes it in a Triton kernel (kernels/ops/kvcache/mxfp8_quant_store_kv.py)
  that needs CUDA; Triton's CPU interpreter rounds float8 wrongly (codes a binade off were seen),
  so it is pinned against a brute-force reading of that kernel written independently.
- nvfp4: SGLang quantizes through FlashInfer's ``nvfp4_kv_quant`` CUDA kernel (SM100+): the
  quantizer is pinned against a brute-force reading of that kernel (float32 steps in numpy); the
  read back against SGLang's own torch dequantize (its SM90 fallback, the platform patched).
- bytes per token: against SGLang's pool sizing (``DefaultPoolConfigurator._compute_cell_size``)
  with a stand-in configurator, a CUDA check patched out and nvfp4 on trtllm_mha.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sgl_ragged.emulator.sglang_caches import (
    E2M1_MIDPOINTS,
    E2M1_VALUES,
    FP8_MAX,
    STOCK_FORMATS,
    fp4_mx_block16_dequantize,
    fp4_mx_block16_quantize,
    fp8_e4m3_quantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    stock_format,
)

TOKENS, HEADS, HEAD_DIM = 6, 2, 64


def _inputs(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, H, D]: normal values plus a zero token, a zero block, tiny (subnormal-range) values,
    outlier channels, values beyond every format's range, and E2M1 midpoints at block scale 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=gen) * 3
    x[0] = 0.0
    x[1, 0, :32] = 0.0
    x[1, 1, :16] = torch.randn(16, generator=gen) * 1e-4
    x[2, :, 7] *= 300.0
    x[3, 0, 40] = 1e4
    x[3, 1, 3] = -7e5
    ties = torch.tensor(E2M1_MIDPOINTS + E2M1_VALUES[1:], dtype=torch.float32)  # 14 values
    signs = torch.where(torch.rand(14, generator=gen) < 0.5, -1.0, 1.0)
    x[4, 0, :16] = torch.cat([ties * signs, torch.tensor([6.0, -0.1])])  # amax 6: scale 1
    x[5, 1, 32:64] = torch.linspace(-448.0, 448.0, 32)
    return x.to(dtype)


# ---- brute-force number formats ------------------------------------------------------------


def _f32(v: float) -> float:
    return float(np.float32(v))


def _e4m3_magnitudes() -> list[tuple[int, float]]:
    """(code, value) of every non-negative finite float8_e4m3fn (0x7F is NaN)."""
    out = []
    for code in range(0x7F):
        exp, man = code >> 3, code & 7
        out.append((code, man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)))
    return out


E4M3 = _e4m3_magnitudes()


def _e4m3(a: float) -> float:
    """a's nearest float8_e4m3fn, ties to the even code, saturating at ±448."""
    if abs(a) >= FP8_MAX:
        return math.copysign(FP8_MAX, a)
    _, value = min(E4M3, key=lambda cv: (abs(cv[1] - abs(a)), cv[0] % 2))
    return math.copysign(value, a)


def _e2m1(a: float, ties_up: bool) -> float:
    """a's nearest E2M1 value, saturating at ±6: ties upward (SGLang's fp4_mx_block16) or to
    the even code (cvt.rn.satfinite, nvfp4)."""
    if math.isnan(a):
        return 0.0
    m = min(abs(a), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_VALUES[i] - m), -i if ties_up else i % 2))
    return math.copysign(E2M1_VALUES[best], a)


def _blocks(x: torch.Tensor, block: int) -> list[list[float]]:
    return x.float().reshape(-1, block).tolist()


def _brute_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp8_quant_store_kv.py's kernel, block by block: (values read back, biased scales)."""
    values, scales = [], []
    for block in _blocks(x, 32):
        amax = max(max(abs(v) for v in block), _f32(1e-30))
        biased = min(max(math.ceil(math.log2(np.float32(amax) / np.float32(448.0))) + 127, 0), 254)
        scale = 2.0 ** (biased - 127)
        values += [_e4m3(max(min(v / scale, FP8_MAX), -FP8_MAX)) * scale for v in block]
        scales.append(biased)
    return torch.tensor(values).view(x.shape), torch.tensor(scales).view(*x.shape[:2], -1)


def _brute_nvfp4(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's nvfp4_kv_quant, block by block, float32 steps in numpy: (values read back,
    block scales)."""
    f = np.float32
    values, scales = [], []
    for block in _blocks(x, 16):
        amax = max(abs(v) for v in block)
        sf = _e4m3(float((f(amax) * f(1.0 / 6.0)) * f(1.0 / g)))
        scales.append(sf)
        if sf == 0.0:  # codes of an all-zero or underflowing block read back as 0
            values += [0.0] * 16
            continue
        inverse = f(1.0) / (f(sf) * f(g))
        values += [float(f(_e2m1(float(f(v) * inverse), ties_up=False)) * f(sf) * f(g)) for v in block]
    return torch.tensor(values).view(x.shape), torch.tensor(scales).view(*x.shape[:2], -1)


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_fp8_e4m3_matches_sglang_cpu_method_and_brute_force(seed: int) -> None:
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import CPUFP8KVCacheMethod

    x = _inputs(seed)
    method = CPUFP8KVCacheMethod()
    buffers = method.create_buffers(TOKENS, HEADS, HEAD_DIM, 1, "cpu")
    k_buf, v_buf = buffers["k_buffer"][0], buffers["v_buffer"][0]
    method.quantize_and_store(k_buf, v_buf, None, None, torch.arange(TOKENS), x, -x)
    assert torch.equal(fp8_e4m3_quantize(x).codes.view(torch.uint8), k_buf.view(torch.uint8))
    assert torch.equal(fp8_e4m3_quantize(-x).codes.view(torch.uint8), v_buf.view(torch.uint8))
    brute = torch.tensor([_e4m3(v) for v in x.flatten().tolist()]).view(x.shape)
    assert torch.equal(STOCK_FORMATS["fp8_e4m3"].roundtrip(x), brute)
    assert STOCK_FORMATS["fp8_e4m3"].roundtrip(x).abs().max() == FP8_MAX  # 1e4 and -7e5 saturate


@pytest.mark.parametrize("seed", range(3))
def test_mxfp8_matches_brute_force_reading_of_the_kernel(seed: int) -> None:
    x = _inputs(seed)
    q = mxfp8_quantize(x)
    values, scales = _brute_mxfp8(x)
    assert torch.equal(q.scales.long(), scales)
    assert torch.equal(STOCK_FORMATS["mxfp8"].roundtrip(x), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(2))
def test_fp4_mx_block16_matches_sglang(dtype: torch.dtype, seed: int) -> None:
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
        FP4MXBlock16KVCacheMethod,
    )

    x = _inputs(seed, dtype)
    method = FP4MXBlock16KVCacheMethod()
    buffers = method.create_buffers(TOKENS, HEADS, HEAD_DIM, 1, "cpu")
    k_buf, k_sf = buffers["k_buffer"][0], buffers["k_scale_buffer"][0]
    method.quantize_and_store(k_buf, buffers["v_buffer"][0], k_sf, buffers["v_scale_buffer"][0],
                              torch.arange(TOKENS), x, -x)  # fmt: skip
    q = fp4_mx_block16_quantize(x)
    assert torch.equal(q.codes, k_buf) and torch.equal(q.scales, k_sf)
    read = method.dequantize_kv_tensor(k_buf, k_sf, 0)  # bf16, what its attention reads
    assert torch.equal(fp4_mx_block16_dequantize(q, torch.bfloat16), read)
    assert torch.equal(STOCK_FORMATS["fp4_mx_block16"].roundtrip(x), read.to(dtype))


@pytest.mark.parametrize("global_scale", [1.0, 0.05, 3.0])
@pytest.mark.parametrize("seed", range(3))
def test_nvfp4_matches_brute_force_reading_of_flashinfer(seed: int, global_scale: float) -> None:
    x = _inputs(seed)
    q = nvfp4_quantize(x, global_scale)
    values, scales = _brute_nvfp4(x, global_scale)
    assert torch.equal(q.scales.float(), scales)
    assert torch.equal(nvfp4_dequantize(q, torch.float32, global_scale), values)


@pytest.mark.parametrize("global_scale", [1.0, 0.05])
def test_nvfp4_read_back_matches_sglang_dequantize(monkeypatch, global_scale: float) -> None:
    from sglang.srt.layers.quantization import kvfp4_tensor

    # SGLang's pure-torch dequantize is its SM90 path; its broadcast is right for one row only,
    # so the whole tensor goes in as one row of 16-element blocks.
    monkeypatch.setattr(kvfp4_tensor, "get_platform",
                        lambda: SimpleNamespace(is_sm100=False, is_sm120=False, is_sm90=True))
    x = _inputs(5)
    q = nvfp4_quantize(x, global_scale)
    read = kvfp4_tensor.NVFP4KVQuantizeUtil.dequantize(
        q.codes.reshape(1, 1, -1), q.scales.reshape(1, 1, -1), global_scale, torch.float32)
    assert torch.equal(nvfp4_dequantize(q, torch.float32, global_scale), read.view(x.shape))


def test_ties_differ_between_the_two_fp4_formats() -> None:
    """At block scale 1 (amax 6), 2.5 is a tie: fp4_mx_block16 rounds it up, nvfp4 to even."""
    x = torch.zeros(1, 1, 16)
    x[0, 0, :3] = torch.tensor([6.0, 2.5, 0.25])
    assert STOCK_FORMATS["fp4_mx_block16"].roundtrip(x)[0, 0, :3].tolist() == [6.0, 3.0, 0.5]
    assert STOCK_FORMATS["nvfp4"].roundtrip(x)[0, 0, :3].tolist() == [6.0, 2.0, 0.0]


# ---- bytes ---------------------------------------------------------------------------------


def _sglang_cell_size(monkeypatch, dtype_name: str, heads: int, head_dim: int, layers: int) -> int:
    """SGLang's own bytes per token for --kv-cache-dtype dtype_name, from its pool configurator
    with a stand-in KVCacheConfigurator (MHA model; nvfp4 on trtllm_mha for prefill and decode,
    SM100's native scale layout; fp4_mx_block16 on triton)."""
    from sglang.srt.layers.quantization import fp4_kv_cache_quant_method as fp4_methods
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.model_executor import pool_configurator
    from sglang.srt.runtime_context import get_parallel

    backend = "trtllm_mha" if dtype_name == "nvfp4" else "triton"
    monkeypatch.setattr(pool_configurator, "is_float4_e2m1fn_x2",  # checks for CUDA too
                        lambda dtype: dtype == getattr(torch, "float4_e2m1fn_x2", None))
    monkeypatch.setattr(fp4_methods, "get_platform", lambda: SimpleNamespace(is_sm100=True))
    monkeypatch.setattr(fp4_methods.KVCacheQuantMethodBase,
                        "configure_attention_backends_from_server_args",
                        lambda self, args: self.configure_attention_backends(backend, backend))
    _, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=dtype_name, model=None, model_dtype=torch.bfloat16,
        is_draft_worker=False, is_dflash=False, speculative_draft_attention_backend=None)
    model = SimpleNamespace(head_dim=head_dim, v_head_dim=head_dim, hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                            get_num_kv_heads=lambda *_: heads)
    kvc = SimpleNamespace(model_config=model, kv_cache_dtype=dtype, kv_cache_dtype_str=dtype_name,
                          server_args=SimpleNamespace(enable_hisparse=True),  # skips a DSA check
                          use_mla_backend=False, device="cpu", page_size=64)
    configurator = pool_configurator.DefaultPoolConfigurator.__new__(
        pool_configurator.DefaultPoolConfigurator)
    configurator.kv_cache_dtype_str = dtype_name
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        return configurator._compute_cell_size(kvc, layers)


@pytest.mark.parametrize("heads,head_dim", [(3, 64), (8, 128)])
@pytest.mark.parametrize("name", list(STOCK_FORMATS))
def test_bytes_per_token_match_sglang_pool_sizing(monkeypatch, name: str, heads: int,
                                                  head_dim: int) -> None:  # fmt: skip
    layers = 30
    expected = _sglang_cell_size(monkeypatch, name, heads, head_dim, layers)
    assert layers * STOCK_FORMATS[name].bytes_per_token(head_dim, heads) == expected


def test_bytes_fractions_and_unknown_names() -> None:
    fractions = {name: f.bytes_fraction(64) for name, f in STOCK_FORMATS.items()}
    assert fractions == {"fp8_e4m3": 0.5, "mxfp8": 0.515625, "fp4_mx_block16": 0.28125,
                         "nvfp4": 0.28125}  # fmt: skip
    with pytest.raises(ValueError, match="unknown SGLang KV cache dtype 'fp4'.*nvfp4"):
        stock_format("fp4")
    with pytest.raises(ValueError, match="not a multiple of the 32-element"):
        mxfp8_quantize(torch.zeros(1, 1, 48))


# ---- the offline emulator's selection ------------------------------------------------------


@pytest.mark.parametrize("name", list(STOCK_FORMATS))
def test_stock_cache_keeps_every_token_and_reads_it_back_as_sglang(name: str) -> None:
    from sgl_ragged.emulator.compressed import StockCache, StockFp8

    k = _inputs(1).view(2, 3, HEADS, HEAD_DIM)  # [N pages, P, H, D]
    v = _inputs(2).view(2, 3, HEADS, HEAD_DIM)
    scores, sinks = torch.rand(2, HEADS, 3), torch.zeros(2, 3, dtype=torch.bool)
    cache = StockCache(name)
    assert cache.keep(0, scores, sinks).all()
    got_k, got_v = cache.sealed_kv(0, scores, sinks, k, v)
    fmt = stock_format(name)
    assert torch.equal(got_k, fmt.roundtrip(_inputs(1)).view_as(k))
    assert torch.equal(got_v, fmt.roundtrip(_inputs(2)).view_as(v))
    assert StockFp8() == StockCache("fp8_e4m3")
    with pytest.raises(ValueError, match="unknown SGLang KV cache dtype"):
        StockCache("fp4")
