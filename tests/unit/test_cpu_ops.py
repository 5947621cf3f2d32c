"""compat/cpu_ops.py and cuda_ext/elementwise.cpp: RMSNorm and the rotary embedding in one native
call each, against SGLang's own torch forms (`forward_native`) on fresh random inputs, and the
calls the hooks must leave to SGLang."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402
from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402

from sgl_ragged import native  # noqa: E402
from sgl_ragged.attention_backend import ops  # noqa: E402
from sgl_ragged.compat import cpu_ops  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# SGLang's torch forms as the class defines them (the hooks are installed only in servers).
TORCH_NORM = RMSNorm.forward_native
TORCH_ROPE = RotaryEmbedding.forward_native
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("RAGGED_CPU_OPS", raising=False)
    cpu_ops.enabled.cache_clear()
    yield
    cpu_ops.enabled.cache_clear()


def _norm(hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype, seed: int,
          **kwargs: Any) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5, **kwargs)
    norm.weight.data = (1 + 0.5 * torch.randn(hidden, generator=torch.Generator()
                                               .manual_seed(seed))).to(weight_dtype)
    return norm


def _within_a_step(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out is ref, or one unit in the last place of a 16-bit dtype away where the two sums of
    squares (another order) round the scaled value to neighbours; NaN where ref has NaN. In
    float32 nothing rounds the difference away: the factor 1 / RMS differs by about a unit, and
    the products after it carry that on (4 units allowed)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.double(), ref.double()
    assert torch.equal(o.isnan(), r.isnan())
    ok = ~r.isnan()
    err = (o[ok] - r[ok]).abs()
    units = 4 if out.dtype == torch.float32 else 1
    assert (err <= units * ULP[out.dtype] * r[ok].abs() + 1e-30).all(), err.max()
    if out.dtype != torch.float32 and ok.any():
        assert (out[ok] != ref[ok]).float().mean() < 0.01  # neighbours are rare, not the rule


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 576), (5, 100), (37, 7), (700, 576), (0, 64), (2, 3, 48)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_sglangs(dtype: torch.dtype, weight_dtype: torch.dtype,
                             shape: tuple[int, ...], with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape) * 13 + with_residual)
    norm = _norm(shape[-1], dtype, weight_dtype, seed=shape[-1])
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    residual = torch.randn(*shape, generator=gen).to(dtype) if with_residual else None
    ref = TORCH_NORM(norm, x, residual)
    for threads in (1, 2):
        with ops.intra_op_threads(threads):
            out = native.load().rms_norm(x, residual, norm.weight.data, norm.variance_epsilon)
        if with_residual:
            _within_a_step(out[0], ref[0])
            assert torch.equal(out[1], ref[1])  # x + residual rounded once: exact
        else:
            assert len(out) == 1
            _within_a_step(out[0], ref)


def test_rms_norm_against_float64() -> None:
    """The formula itself, not only its agreement with torch: out is the float64 value rounded."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 960, generator=gen).bfloat16()
    residual = torch.randn(64, 960, generator=gen).bfloat16()
    w = torch.randn(960, generator=gen).bfloat16()
    out, res = native.load().rms_norm(x, residual, w, 1e-6)
    s = x.double() + residual.double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert ((out.double() - ref).abs() <= ULP[torch.bfloat16] * ref.abs() + 1e-12).all()
    assert torch.equal(res, s.bfloat16())


def test_rms_norm_special_values_as_torch() -> None:
    norm = _norm(64, torch.bfloat16, torch.bfloat16, seed=1)
    x = torch.randn(4, 64).bfloat16()
    x[0, 3], x[1, 5], x[2, :] = float("inf"), float("nan"), 0.0
    x[3, 0] = 3.0e38  # its square overflows float32
    ref = TORCH_NORM(norm, x)
    out = native.load().rms_norm(x, None, norm.weight.data, norm.variance_epsilon)[0]
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


def _qkv(tokens: int, heads: int, kv_heads: int, head: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query and key as the strided column slices of a packed qkv, as SGLang's attention has them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (4 * torch.randn(tokens, (heads + 2 * kv_heads) * head, generator=gen)).to(dtype)
    q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", ["same", torch.float32])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head,rotary_dim", [(64, 64), (64, 32), (80, 80), (128, 64)])
@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_rotary_is_sglangs_bit_for_bit(dtype: torch.dtype, cache_dtype: Any, neox: bool,
                                       head: int, rotary_dim: int, tokens: int) -> None:
    rope = get_rope(head, rotary_dim=rotary_dim, max_position=4096, base=10000,
                    is_neox_style=neox, dtype=dtype)
    # SGLang casts the cache to the model's dtype on the CPU, keeps it float32 on CUDA
    rope.cos_sin_cache = rope._compute_cos_sin_cache().to(
        dtype if cache_dtype == "same" else cache_dtype)
    q, k = _qkv(tokens, 9, 3, head, dtype, seed=tokens + head + rotary_dim)
    pos = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    ref_q, ref_k = TORCH_ROPE(rope, pos, q, k)
    for threads in (1, 2):
        with ops.intra_op_threads(threads):
            out_q, out_k = native.load().rotary_embedding(pos, q, k, rope.cos_sin_cache, head, neox)
        assert out_q.shape == q.shape and out_q.is_contiguous()
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


def test_rotary_three_dim_heads() -> None:
    rope = get_rope(64, rotary_dim=64, max_position=512, base=10000, is_neox_style=True,
                    dtype=torch.bfloat16)
    q, k = (t.reshape(5, -1, 64) for t in _qkv(5, 4, 2, 64, torch.bfloat16, seed=3))
    pos = torch.arange(5) * 100
    ref = TORCH_ROPE(rope, pos, q, k)
    out = native.load().rotary_embedding(pos, q.contiguous(), k.contiguous(), rope.cos_sin_cache,
                                         64, True)
    assert out[0].shape == (5, 4, 64)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def _width_cases() -> list[tuple[str, tuple[Any, ...]]]:
    """Inputs that reach every loop: tails of the 16 partial sums and of each vector width, rows
    split over threads (700 x 576 outputs), every dtype pair, both rotary styles, partial
    rotary dims and strided query / key rows; the Hadamard rows on every loop (below 8 floats,
    in registers at 64 and 128, through memory, and the scalar loop past 1024), 64-float rows
    split over threads."""
    gen = torch.Generator().manual_seed(11)
    cases: list[tuple[str, tuple[Any, ...]]] = []
    for dtype in DTYPES:
        for wdt in (torch.bfloat16, torch.float32, torch.float16):
            for rows, hidden in ((1, 576), (5, 100), (37, 7), (700, 576)):
                x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
                res = torch.randn(rows, hidden, generator=gen).to(dtype)
                w = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(wdt)
                cases += [("rms_norm", (x, None, w, 1e-5)), ("rms_norm", (x, res, w, 1e-6))]
        for neox in (True, False):
            for head, rot, tokens in ((64, 64, 300), (64, 32, 3), (80, 80, 1), (128, 64, 17)):
                cache = torch.randn(4096, rot, generator=gen).to(dtype)
                q, k = _qkv(tokens, 9, 3, head, dtype, seed=head + rot + tokens)
                pos = torch.randint(0, 4096, (tokens,), generator=gen)
                cases.append(("rotary_embedding", (pos, q, k, cache, head, neox)))
        for d, tokens, heads, kv in ((4, 3, 2, 1), (64, 300, 9, 3), (128, 17, 4, 4),
                                     (256, 5, 6, 2), (2048, 2, 3, 3)):
            x = torch.randn(tokens, heads + 3, d, generator=gen).to(dtype)[:, :heads]  # strided
            signs = torch.where(torch.rand(kv, d, generator=gen) < 0.5, -1.0, 1.0)
            cases += [("hadamard_heads", (x, signs, False)), ("hadamard_heads", (x, signs, True))]
    return cases


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_every_width_gives_the_same_bits(isa: str, tmp_path: Path) -> None:
    """The loops are built for AVX-512, AVX2 and the baseline and run at the attention's ISA
    variant (RAGGED_NATIVE_ISA forces a lower one, once per process: so in a child). Every width
    sums the squares in the same 16 partial sums and contracts nothing, so a lower one gives
    this process's outputs bit for bit (which the tests above hold to SGLang's, and
    tests/unit/test_rotated_rows.py the Hadamard rows to rotation.py's)."""
    if isa == "avx2" and not {"avx2", "f16c"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    m = native.load()
    cases = _width_cases()
    outs = [getattr(m, name)(*a) for name, a in cases]
    torch.save({"cases": cases, "outs": outs}, tmp_path / "cases.pt")
    code = (
        "import sys, torch\n"
        "from sgl_ragged import native\n"
        "m = native.load()\n"
        f"assert m.isa() == {isa!r}, m.isa()\n"
        "d = torch.load(sys.argv[1], weights_only=False)\n"
        "for i, ((name, a), want) in enumerate(zip(d['cases'], d['outs'])):\n"
        "    got = getattr(m, name)(*a)\n"
        "    got, want = ([got], [want]) if isinstance(got, torch.Tensor) else (got, want)\n"
        "    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want)),"
        " (i, name, [t.shape for t in a if isinstance(t, torch.Tensor)])\n"
        "print('ok', len(d['cases']))\n")
    env = {**os.environ, "RAGGED_NATIVE_ISA": isa, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cases.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["ok", str(len(cases))], \
        done.stderr[-2000:]


def test_kernels_refuse_bad_input() -> None:
    m = native.load()
    rope = get_rope(64, rotary_dim=64, max_position=128, base=10000, is_neox_style=True,
                    dtype=torch.bfloat16)
    q, k = _qkv(2, 2, 1, 64, torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="position 128 of token 1 is outside"):
        m.rotary_embedding(torch.tensor([0, 128]), q, k, rope.cos_sin_cache, 64, True)
    with pytest.raises(RuntimeError, match="rotary_dim 64 .* at most head_size 48"):
        m.rotary_embedding(torch.tensor([0, 1]), q, k, rope.cos_sin_cache, 48, True)
    with pytest.raises(RuntimeError, match="not made of heads of head_size 96"):
        m.rotary_embedding(torch.tensor([0, 1]), q, k, rope.cos_sin_cache, 96, True)
    with pytest.raises(RuntimeError, match="query is BFloat16 but key is Float"):
        m.rotary_embedding(torch.tensor([0, 1]), q, k.float(), rope.cos_sin_cache, 64, True)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=r"weight \[32\] must be a contiguous \[64\]"):
        m.rms_norm(x, None, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="residual .* must be contiguous, on the CPU, with x's"):
        m.rms_norm(x, torch.randn(3, 64).bfloat16(), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, got Double"):
        m.rms_norm(x.double(), None, torch.ones(64), 1e-6)


class _Original:
    """Stands for the torch form the hook wraps, and counts the calls it was left."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_norm_hook_runs_the_native_form_and_leaves_variants() -> None:
    x, residual = torch.randn(3, 96).bfloat16(), torch.randn(3, 96).bfloat16()
    plain = _norm(96, torch.bfloat16, torch.bfloat16, seed=2)
    original = _Original(TORCH_NORM)
    out, res = cpu_ops.rms_norm_native(original, plain, x, residual)
    assert original.calls == 0
    ref = TORCH_NORM(plain, x, residual)
    _within_a_step(out, ref[0])
    assert torch.equal(res, ref[1])
    _within_a_step(cpu_ops.rms_norm_native(original, plain, x), TORCH_NORM(plain, x))
    assert original.calls == 0
    variants = [
        (_norm(96, torch.bfloat16, torch.bfloat16, 2, cast_x_before_out_mul=True), (x, residual)),
        (_norm(96, torch.bfloat16, torch.bfloat16, 2, fp32_residual=True), (x, residual)),
        (_norm(96, torch.bfloat16, torch.bfloat16, 2, var_hidden_size=64), (x,)),
        (_norm(96, torch.bfloat16, torch.bfloat16, 2, override_orig_dtype=torch.float32), (x,)),
        (plain, (x, residual, torch.ones_like(x))),  # post_residual_addition
        (plain, (x, residual.float())),  # a residual of another dtype
        (plain, (x.double(),)),
    ]
    for i, (norm, args) in enumerate(variants):
        result = cpu_ops.rms_norm_native(original, norm, *args)
        assert original.calls == i + 1, i
        expected = TORCH_NORM(norm, *args)
        for a, b in zip(result if isinstance(result, tuple) else [result],
                        expected if isinstance(expected, tuple) else [expected], strict=True):
            assert torch.equal(a, b), i


def test_rope_hook_runs_the_native_form_and_leaves_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    rope = get_rope(64, rotary_dim=64, max_position=512, base=10000, is_neox_style=True,
                    dtype=torch.bfloat16)
    q, k = _qkv(4, 3, 1, 64, torch.bfloat16, seed=5)
    pos, offsets = torch.tensor([1, 7, 300, 0]), torch.tensor([2, 2, 2, 2])
    original = _Original(TORCH_ROPE)
    for args in ((pos, q, k), (pos, q, k, offsets)):
        out = cpu_ops.rotary_native(original, rope, *args)
        ref = TORCH_ROPE(rope, *args)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert original.calls == 0
    with pytest.raises(AssertionError, match="fused_set_kv_buffer_arg is not supported"):
        cpu_ops.rotary_native(original, rope, pos, q, k, None, object())  # SGLang's refusal
    assert original.calls == 1
    odd = q[:, :100]  # heads cut mid-way: not the packed layout
    with pytest.raises(RuntimeError):  # SGLang's own error for a shape it cannot view
        cpu_ops.rotary_native(original, rope, pos, odd, k)
    assert original.calls == 2
    rope.sin_cos_cache = rope.cos_sin_cache.index_select(0, pos)
    cpu_ops.rotary_native(original, rope, pos, q, k)
    assert original.calls == 3
    del rope.sin_cos_cache
    monkeypatch.setenv("RAGGED_CPU_OPS", "torch")
    cpu_ops.enabled.cache_clear()
    out = cpu_ops.rotary_native(original, rope, pos, q, k)
    assert original.calls == 4
    assert torch.equal(out[0], TORCH_ROPE(rope, pos, q, k)[0])


def test_bad_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_CPU_OPS", "fast")
    with pytest.raises(ValueError, match="RAGGED_CPU_OPS=fast is not a choice: set it to auto"):
        cpu_ops.validate()
