"""compat/cpu_gemm.py: bfloat16 linear layers as float32 products on CPUs without bfloat16 dots,
checked against a float64 reference on fresh random inputs; the calls it must leave to SGLang."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from sgl_ragged.compat import cpu_gemm

BF16_ULP = 2.0**-7  # bfloat16's relative spacing: 8 bits of significand


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("RAGGED_CPU_GEMM", raising=False)
    cpu_gemm._float32_here.cache_clear()
    yield
    cpu_gemm._float32_here.cache_clear()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _assert_rounded(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out is ref rounded to bfloat16, give or take one bfloat16 step (summation order)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert (err <= BF16_ULP * ref.abs() + 1e-6).all(), err.max()


@pytest.mark.parametrize("shape", [(16, 576, 960), (37, 1536, 576), (256, 64, 3072)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_products_match_the_reference(shape: tuple[int, int, int], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + with_bias)
    m, k, n = shape
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    ref = _reference(x, w, b)
    _assert_rounded(cpu_gemm.linear(x, w, b), ref)
    _assert_rounded(F.linear(x, w, b), ref)  # torch's bfloat16 product: the same answer


class _Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k).to(dtype), requires_grad=False)


class _Original:
    """Stands for SGLang's UnquantizedLinearMethod.apply and records that it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, method: Any, layer: torch.nn.Module, x: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return F.linear(x, layer.weight, bias)


def _run(x: torch.Tensor, layer: torch.nn.Module) -> tuple[torch.Tensor, int]:
    original = _Original()
    out = cpu_gemm.apply(original, object(), layer, x)
    return out, original.calls


def test_chunks_take_float32_and_short_calls_stay_with_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_CPU_GEMM", "float32")
    layer = _Layer(96, 64)
    rows = cpu_gemm.FLOAT32_ROWS
    x = torch.randn(rows, 64).bfloat16()
    out, calls = _run(x, layer)
    assert calls == 0
    _assert_rounded(out, _reference(x, layer.weight, None))
    # [batch, tokens, hidden] counts its rows over both leading dimensions
    out, calls = _run(x.view(2, rows // 2, 64), layer)
    assert calls == 0 and out.shape == (2, rows // 2, 96)
    _, calls = _run(x[: rows - 1], layer)
    assert calls == 1


@pytest.mark.parametrize("case", ["float32 rows", "amx layer", "choice bfloat16"])
def test_calls_it_leaves_to_sglang(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_CPU_GEMM", "bfloat16" if case == "choice bfloat16" else "float32")
    layer = _Layer(32, 64, torch.float32 if case == "float32 rows" else torch.bfloat16)
    if case == "amx layer":
        layer.use_intel_amx_backend = True
    x = torch.randn(64, 64).to(layer.weight.dtype)
    _, calls = _run(x, layer)
    assert calls == 1


@pytest.mark.parametrize(("flags", "float32"), [
    (set(), True),  # no AVX at all: the scalar loops are slowest in bfloat16
    ({"avx2", "fma", "f16c"}, True),
    ({"avx512f", "avx512bw"}, True),
    ({"avx512f", "avx512_bf16"}, False),
    ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, False),
])
def test_auto_picks_float32_where_the_cpu_has_no_bfloat16_dots(
        flags: set[str], float32: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset(flags))
    assert cpu_gemm.float32_products() is float32
    monkeypatch.setenv("RAGGED_CPU_GEMM", "auto")
    assert cpu_gemm.float32_products() is float32
    monkeypatch.setenv("RAGGED_CPU_GEMM", "float32")
    assert cpu_gemm.float32_products()
    monkeypatch.setenv("RAGGED_CPU_GEMM", "bfloat16")
    assert not cpu_gemm.float32_products()


def test_a_bad_choice_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_CPU_GEMM", "fp32")
    with pytest.raises(ValueError, match=r"RAGGED_CPU_GEMM=fp32 is not a choice: set it to float32"):
        cpu_gemm.float32_products()


def test_the_flags_are_this_machines() -> None:
    flags = cpu_gemm.cpu_flags()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "avx2" in flags


def test_sglangs_own_linear_method_through_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real UnquantizedLinearMethod.apply as `original`: both routes give the same rows."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    method = UnquantizedLinearMethod()
    layer = torch.nn.Module()
    method.create_weights(layer, 64, [48, 48], 64, 96, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64) / 8)
    x = torch.randn(40, 64).bfloat16()
    ref = _reference(x, layer.weight, None)
    for choice in ("float32", "bfloat16"):
        monkeypatch.setenv("RAGGED_CPU_GEMM", choice)
        cpu_gemm._float32_here.cache_clear()
        _assert_rounded(cpu_gemm.apply(UnquantizedLinearMethod.apply, method, layer, x), ref)
