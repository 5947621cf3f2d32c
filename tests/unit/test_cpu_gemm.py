"""compat/cpu_gemm.py: bfloat16 linear layers (and the lm_head) by the native kernel or as float32
products on CPUs without bfloat16 dots, checked against a float64 reference on fresh random inputs;
the calls it must leave to SGLang. The kernel itself: tests/unit/test_native_linear.py."""

from __future__ import annotations

import subprocess
import sys
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
    cached = (cpu_gemm._routes_here, cpu_gemm._dot_rows, cpu_gemm.kernel)  # before a test
    # replaces them
    for f in cached:
        f.cache_clear()
    yield
    for f in cached:
        f.cache_clear()


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


@pytest.mark.parametrize(("flags", "dot_rows", "built_want", "unbuilt_want"), [
    (set(), 0, "native", "float32"),  # no AVX at all: the scalar loops are slowest in bfloat16
    ({"avx2", "fma", "f16c"}, 0, "native", "float32"),
    ({"avx512f", "avx512bw"}, 0, "native", "float32"),
    ({"avx512f", "avx512_bf16"}, 24, "decode", "bfloat16"),
    ({"avx512f", "avx512_bf16"}, 0, "bfloat16", "bfloat16"),  # RAGGED_NATIVE_ISA=avx2
    ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, 24, "decode", "bfloat16"),
    ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, 0, "bfloat16", "bfloat16"),
])
@pytest.mark.parametrize("built", [True, False])
def test_auto_routes_by_the_cpus_bfloat16_dots(
        flags: set[str], dot_rows: int, built_want: str, unbuilt_want: str, built: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_gemm.native, "is_built", lambda: built)
    monkeypatch.setattr(cpu_gemm.native, "available", lambda: built)
    monkeypatch.setattr(cpu_gemm, "_dot_rows", lambda: dot_rows)
    want = built_want if built else unbuilt_want
    assert cpu_gemm.routes() == want
    monkeypatch.setenv("RAGGED_CPU_GEMM", "auto")
    assert cpu_gemm.routes() == want
    for choice in ("float32", "bfloat16"):
        monkeypatch.setenv("RAGGED_CPU_GEMM", choice)
        assert cpu_gemm.routes() == choice
    monkeypatch.setenv("RAGGED_CPU_GEMM", "native")
    if built:
        assert cpu_gemm.routes() == "native"
    else:
        with pytest.raises(ValueError, match=r"RAGGED_CPU_GEMM=native needs the native kernels: "
                                             r"build them with `python -m sgl_ragged.native build`"):
            cpu_gemm.validate()


def test_a_bad_choice_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_CPU_GEMM", "fp32")
    with pytest.raises(ValueError, match=r"RAGGED_CPU_GEMM=fp32 is not a choice: set it to auto "
                                         r"\(.*\); native .*; float32 .*; bfloat16"):
        cpu_gemm.validate()


@pytest.mark.parametrize(("env", "count"), [
    ({}, 300000),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, 0),
    ({"OMP_WAIT_POLICY": "active"}, float("inf")),
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}, 3000),  # scripts/serve.sh's
    ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "0"}, 0),
    ({"GOMP_SPINCOUNT": "3k"}, 3000),
    ({"GOMP_SPINCOUNT": "2M"}, 2_000_000),
    ({"GOMP_SPINCOUNT": "INFINITE"}, float("inf")),
    ({"GOMP_SPINCOUNT": " "}, 300000),
])
def test_the_spin_count_libgomp_reads(env: dict[str, str], count: float) -> None:
    assert cpu_gemm.omp_spin_count(env) == count


def test_the_dots_split_from_2_18_products_on_the_pool_or_where_workers_spin() -> None:
    """Brute force over the settings that decide it: RAGGED_DOT_SERIAL_MACS outright, else
    2^18 on the kernels' own pool (the default) or from SPLIT_SPIN spins of OpenMP's workers,
    2^22 (the kernel's default) under OpenMP below that."""
    for spin in ("0", "300", "2999", "3000", "3k", "300000", "infinity", None):
        for policy in ("passive", "active", None):
            for forced in ("262144", "0", None):
                for pool in ("pool", "openmp", "", None):
                    env = {k: v for k, v in (("GOMP_SPINCOUNT", spin), ("OMP_WAIT_POLICY", policy),
                                             ("RAGGED_DOT_SERIAL_MACS", forced),
                                             ("RAGGED_NATIVE_POOL", pool)) if v is not None}
                    count = cpu_gemm.omp_spin_count(env)
                    want = (int(forced) if forced is not None
                            else 2**18 if pool != "openmp" or count >= 3000 else 2**22)
                    assert cpu_gemm.dot_serial_macs(env) == want, env


@pytest.mark.parametrize(("name", "value", "message"), [
    ("GOMP_SPINCOUNT", "fast", r"GOMP_SPINCOUNT=fast is not a spin count"),
    ("GOMP_SPINCOUNT", "-5", r"GOMP_SPINCOUNT=-5 is not a spin count"),
    ("RAGGED_DOT_SERIAL_MACS", "2^18", r"RAGGED_DOT_SERIAL_MACS=2\^18 is not a count of products"),
    ("RAGGED_NATIVE_POOL", "omp", r"RAGGED_NATIVE_POOL=omp is not a choice"),
])
def test_a_bad_spin_setting_says_what_to_set(name: str, value: str, message: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        cpu_gemm.validate()


def test_the_kernel_is_set_for_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_ragged import native

    if not (native.is_built() and native.available()):
        pytest.skip(f"native kernels: {native.reason()}")
    module = native.load()
    default = module.linear_dot_serial_macs()
    try:
        for env, want in (({"GOMP_SPINCOUNT": "3000"}, 2**18), ({"GOMP_SPINCOUNT": "0"}, 2**18),
                          ({"GOMP_SPINCOUNT": "0", "RAGGED_NATIVE_POOL": "openmp"}, 2**22),
                          ({"RAGGED_DOT_SERIAL_MACS": "12345"}, 12345)):
            for name in ("GOMP_SPINCOUNT", "RAGGED_NATIVE_POOL"):
                monkeypatch.delenv(name, raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            cpu_gemm.kernel.cache_clear()
            assert cpu_gemm.kernel() is module and module.linear_dot_serial_macs() == want
    finally:
        module.set_linear_dot_serial_macs(default)


def test_the_builds_own_threshold_is_serial_macs_default() -> None:
    """linear.cpp's threshold before any process sets it is the one cpu_gemm calls its default:
    a fresh process that loads the build and sets nothing reads SERIAL_MACS_DEFAULT."""
    from sgl_ragged import native

    if not (native.is_built() and native.available()):
        pytest.skip(f"native kernels: {native.reason()}")
    code = "from sgl_ragged import native; print(native.load().linear_dot_serial_macs())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert int(out.stdout.split()[-1]) == cpu_gemm.SERIAL_MACS_DEFAULT, out.stdout


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
    for choice in ("native", "float32", "bfloat16"):
        monkeypatch.setenv("RAGGED_CPU_GEMM", choice)
        cpu_gemm._routes_here.cache_clear()
        for rows in (1, 3, 40):
            _assert_rounded(cpu_gemm.apply(UnquantizedLinearMethod.apply, method, layer, x[:rows]),
                            ref[:rows])


def _routes_taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    taken: list[str] = []
    product = cpu_gemm.product

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, how: str) -> torch.Tensor:
        taken.append(how)
        return product(x, w, b, how)

    monkeypatch.setattr(cpu_gemm, "product", spy)
    return taken


def test_native_route_at_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches and prefill chunks alike (the kernel's two layouts: below and from 8
    rows)."""
    monkeypatch.setenv("RAGGED_CPU_GEMM", "native")
    taken = _routes_taken(monkeypatch)
    layer = _Layer(40, 64)
    with torch.no_grad():
        layer.weight.div_(8)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 7, 8, 127, 512):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        out, calls = _run(x, layer)
        assert calls == 0
        _assert_rounded(out, _reference(x, layer.weight, None))
    assert taken == ["native"] * 6
    # a non-contiguous weight (a transposed view) goes to float32, never to the kernel
    taken.clear()
    view = torch.nn.Module()
    view.weight = torch.randn(64, 40).bfloat16().t()
    out, calls = _run(torch.randn(3, 64).bfloat16(), view)
    assert calls == 0 and taken == ["float32"]


@pytest.mark.parametrize("amx", [False, True])
def test_decode_route_below_the_kernels_dot_rows(amx: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on an AVX512-BF16 CPU: decode batches (below linear_dot_rows(), and with AMX below
    AMX_DOT_ROWS too) to the native kernel, larger calls and non-contiguous weights left to
    SGLang's bfloat16 product."""
    from sgl_ragged import native

    flags = {"avx512f", "avx512_bf16"} | ({"amx_bf16", "amx_tile"} if amx else set())
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_gemm, "_dot_rows", lambda: 24)
    assert cpu_gemm.routes() == "decode"
    taken = _routes_taken(monkeypatch)
    layer = _Layer(40, 64)
    with torch.no_grad():
        layer.weight.div_(8)
    gen = torch.Generator().manual_seed(6)
    end = cpu_gemm.AMX_DOT_ROWS if amx else 24
    if amx:
        assert end < 24
    for rows, native_rows in ((1, True), (end - 1, True), (end, False), (23, not amx),
                              (24, False), (200, False)):
        taken.clear()
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        out, calls = _run(x, layer)
        assert (calls, taken) == ((0, ["native"]) if native_rows else (1, []))
        _assert_rounded(out, _reference(x, layer.weight, None))
    view = torch.nn.Module()
    view.weight = torch.randn(64, 40).bfloat16().t()
    taken.clear()
    _, calls = _run(torch.randn(3, 64).bfloat16(), view)
    assert calls == 1 and taken == []
    if native.is_built():  # the kernel says where its dots end on this CPU
        monkeypatch.undo()
        cpu_gemm._dot_rows.cache_clear()
        assert cpu_gemm._dot_rows() == native.load().linear_dot_rows()


class _Head(torch.nn.Module):
    """An unquantized lm_head as SGLang's VocabParallelEmbedding holds it."""

    def __init__(self, vocab: int, hidden: int) -> None:
        from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

        super().__init__()
        gen = torch.Generator().manual_seed(vocab + hidden)
        self.weight = torch.nn.Parameter(
            (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).bfloat16(),
            requires_grad=False)
        self.quant_method = UnquantizedEmbeddingMethod()


def _processor(**changes: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(**{"use_fp32_lm_head": False, "use_fp32_lm_head_output": False,
                              "rl_on_policy_target": None, **changes})


@pytest.mark.parametrize("choice", ["native", "float32"])
def test_the_lm_head_through_the_hook(choice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own _compute_lm_head as `original`: the hook's logits are its plain branch's."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    monkeypatch.setenv("RAGGED_CPU_GEMM", choice)
    taken = _routes_taken(monkeypatch)
    head = _Head(1000, 64)
    for rows in (1, 5, 32):
        hidden = torch.randn(rows, 64).bfloat16()
        ref = _reference(hidden, head.weight, None)
        mine = cpu_gemm.compute_lm_head(LogitsProcessor._compute_lm_head, _processor(), hidden,
                                        head)
        _assert_rounded(mine, ref)
        _assert_rounded(LogitsProcessor._compute_lm_head(_processor(), hidden, head), ref)
    assert taken == (["native"] * 3 if choice == "native" else ["float32"])


@pytest.mark.parametrize("case", ["fp32 head", "rl target", "lora", "amx", "float32 hidden"])
def test_lm_heads_it_leaves_to_sglang(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_CPU_GEMM", "float32")
    head = _Head(96, 64)
    processor = _processor(use_fp32_lm_head=case == "fp32 head",
                           rl_on_policy_target="fsdp" if case == "rl target" else None)
    if case == "lora":
        head.set_lora = head.apply_lora = lambda *a: None
    if case == "amx":
        head.use_intel_amx_backend = True
    hidden = torch.randn(32, 64).to(torch.float32 if case == "float32 hidden" else torch.bfloat16)
    calls = []

    def original(*args: Any, **kwargs: Any) -> str:
        calls.append(args)
        return "sglang's"

    assert cpu_gemm.compute_lm_head(original, processor, hidden, head) == "sglang's"
    assert len(calls) == 1 and calls[0][1] is hidden
