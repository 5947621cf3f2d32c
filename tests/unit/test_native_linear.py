"""The native bfloat16 linear kernel (cuda_ext/linear.cpp) against a float64 reference on fresh
random inputs: every shape class its layouts have (the AVX2 forms: one row and two, K not a
multiple of 8 or 16, N not a multiple of 4; from 3 rows the split quads: every M % 4 tail, an odd
N, K % 16 tails, K below 16; from 21 rows the panels: every M % 6 tail, N % 16 in each half of a
panel, K % 8 tails, K of 1; on AVX512-BF16, below linear_dot_rows() rows, the dots: every M % 6
tail, N % 4 tails, K % 32 tails), with and without
bias, serial and split over threads, and the lower forms (RAGGED_NATIVE_ISA=avx2, scalar) in
child processes on every shape. Bad arguments get a message that names them. The extension must
build here (as for the attention)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sgl_ragged import native
from sgl_ragged.attention_backend import ops

BF16_ULP = 2.0**-7
ROOT = Path(__file__).resolve().parents[2]

SHAPES = [  # (M, K, N); on AVX2 from 3 rows the split quads (QUAD_ROWS; 4 rows x 2 weight rows,
    # 16 channels), from 21 the panels (PANEL_ROWS, PR = 6 rows, PC = 16 columns); below 128 on
    # AVX512-BF16 the dots (DOT_ROWS; DR = 6 rows, DB = 4 weight rows, 32 channels)
    (1, 576, 960), (2, 576, 576), (3, 1536, 44), (5, 64, 7), (7, 64, 40), (1, 584, 8),
    (1, 7, 5), (4, 15, 4), (2, 13, 6), (26, 100, 17), (29, 64, 33), (30, 1, 20),
    (8, 100, 13), (9, 1, 33), (10, 13, 5), (11, 40, 8), (12, 64, 16), (27, 96, 24),
    (65, 72, 30), (130, 200, 17), (17, 576, 3072), (48, 1536, 576),
    (6, 33, 6), (23, 63, 1), (23, 1536, 49), (24, 40, 9), (25, 31, 18), (37, 576, 960),
    (47, 63, 9), (47, 1536, 49), (48, 40, 9), (49, 31, 18),
    (1, 48, 9), (2, 95, 7), (2, 32, 4), (1, 1552, 11),
    (64, 576, 52), (101, 95, 13), (127, 40, 9), (128, 33, 6),
]


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _assert_rounded(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out is ref rounded to bfloat16, give or take one bfloat16 step: the float32 sums of the
    same products in another order than the float64 reference's differ by far less than that."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert (err <= BF16_ULP * ref.abs() + 1e-6).all(), (err.max(), ref.abs().max())


def _case(m: int, k: int, n: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference(shape: tuple[int, int, int], bias: bool, threads: int) -> None:
    m, k, n = shape
    x, w, b = _case(m, k, n, bias, seed=m * 7919 + k * 31 + n + bias)
    with ops.intra_op_threads(threads):
        out = native.load().linear_bf16(x, w, b)
    _assert_rounded(out, _reference(x, w, b))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] < 128], ids=lambda s: "x".join(map(str, s)))
def test_split_calls_give_the_serial_bits(shape: tuple[int, int, int]) -> None:
    """The dots' split threshold (set_linear_dot_serial_macs: compat/cpu_gemm picks it from the
    OpenMP spin count) moves work between threads, never a bit of the result: each output is
    one thread's sum, whichever thread."""
    module = native.load()
    m, k, n = shape
    x, w, b = _case(m, k, n, True, seed=m * 31 + k + n)
    default = module.linear_dot_serial_macs()
    try:
        with ops.intra_op_threads(2):
            module.set_linear_dot_serial_macs(2**62)
            serial = module.linear_bf16(x, w, b)
            module.set_linear_dot_serial_macs(0)
            split = module.linear_bf16(x, w, b)
    finally:
        module.set_linear_dot_serial_macs(default)
    assert torch.equal(serial, split)
    _assert_rounded(split, _reference(x, w, b))
    with pytest.raises(RuntimeError, match="-1 products is negative"):
        module.set_linear_dot_serial_macs(-1)
    assert module.linear_dot_serial_macs() == default


def test_the_bfloat16_sum_is_torchs_within_a_step() -> None:
    """Against torch's own bfloat16 product of the same operands (what SGLang would compute)."""
    x, w, b = _case(24, 576, 960, True, seed=11)
    out = native.load().linear_bf16(x, w, b).double()
    theirs = F.linear(x, w, b).double()
    assert ((out - theirs).abs() <= 2 * BF16_ULP * theirs.abs() + 1e-6).all()


def test_leading_dims_and_strided_activations() -> None:
    x, w, b = _case(12, 96, 40, True, seed=3)
    lin = native.load().linear_bf16
    out = lin(x.view(3, 4, 96), w, b)
    assert out.shape == (3, 4, 40)
    _assert_rounded(out, _reference(x, w, b).view(3, 4, 40))
    wide = torch.randn(12, 192).bfloat16()
    strided = wide[:, ::2]  # not contiguous: the kernel copies it
    _assert_rounded(lin(strided, w, None), _reference(strided, w, None))
    assert lin(x[:0], w, b).shape == (0, 40)
    # no input features: every sum is empty, so y is the bias (or zeros), as F.linear gives
    empty_w = torch.empty(40, 0, dtype=torch.bfloat16)
    assert torch.equal(lin(x[:, :0], empty_w, b), F.linear(x[:, :0], empty_w, b))
    assert torch.equal(lin(x[:, :0], empty_w, None), torch.zeros(12, 40, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [4, 10, 30])
def test_special_values_pass_through(rows: int) -> None:
    x, w, _ = _case(rows, 64, 20, False, seed=9)
    x[1, 5] = float("inf")
    x.view(torch.int16)[2, 0] = -64  # 0xFFC0: a NaN with the sign set (rounds to 0x7FC0)
    x[3] = 2.0**100  # every term of output 0 (1) is +2^130 (-2^130): +inf (-inf) in any order
    w[0], w[1] = 2.0**30, -(2.0**30)
    out = native.load().linear_bf16(x, w, None)
    assert out[3, 0] == float("inf") and out[3, 1] == float("-inf")
    ref = F.linear(x.float(), w.float())
    for r in (1, 3):
        assert torch.equal(out[r].isinf() | out[r].isnan(), ref[r].isinf() | ref[r].isnan())
        assert torch.equal(out[r][ref[r].isinf()], ref[r][ref[r].isinf()].bfloat16())
    assert out[2].isnan().all()
    if rows < native.load().linear_dot_rows():  # the dots round as at::BFloat16: NaN is 0x7FC0
        assert (out[2].view(torch.int16) == 0x7FC0).all()
    _assert_rounded(out[0], _reference(x[:1], w, None)[0])


@pytest.mark.parametrize(("args", "message"), [
    (lambda x, w, b: (x.float(), w, b), r"x must be a bfloat16 CPU tensor, got Float"),
    (lambda x, w, b: (x, w.float(), b), r"weight must be BFloat16, got Float"),
    (lambda x, w, b: (x[:, :-1], w, b), r"x's last dim must be the weight's 64 input features"),
    (lambda x, w, b: (x, w.t().contiguous().t(), b), r"weight must be contiguous"),
    (lambda x, w, b: (x, w, b[:-1]), r"bias must have the weight's 8 output features, got 7"),
    (lambda x, w, b: (x, w[None], b), r"weight must have 2 dims"),
])
def test_bad_arguments_say_what_is_wrong(args, message: str) -> None:
    x, w, b = _case(3, 64, 8, True, seed=1)
    with pytest.raises(RuntimeError, match=message):
        native.load().linear_bf16(*args(x, w, b))


def _forced_isa() -> str | None:
    return os.environ.get("RAGGED_NATIVE_ISA") or None


def test_the_form_this_cpu_runs() -> None:
    flags = native.cpu_flags()
    forced = _forced_isa()
    if forced == "scalar" or not {"avx2", "fma"} <= flags:
        want, dot_rows = "scalar", 0
    elif forced != "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        want, dot_rows = "avx512_bf16", 128
    else:
        want, dot_rows = "avx2", 0
    assert native.load().linear_isa() == want
    assert native.load().linear_dot_rows() == dot_rows


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_the_lower_forms_in_a_child(isa: str) -> None:
    """RAGGED_NATIVE_ISA=avx2 / scalar: the AVX2 layouts (on a CPU that would run the dots) and
    the portable loops give the same answers on every shape (the form is chosen once per
    process, so in a child)."""
    if isa == "avx2" and not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "from sgl_ragged import native\n"
        "m = native.load()\n"
        f"assert m.linear_isa() == {isa!r} and m.linear_dot_rows() == 0, m.linear_isa()\n"
        "g = torch.Generator().manual_seed(2)\n"
        f"for (M, K, N) in {SHAPES!r}:\n"
        "    x = torch.randn(M, K, generator=g).bfloat16()\n"
        "    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()\n"
        "    b = torch.randn(N, generator=g).bfloat16()\n"
        "    ref = F.linear(x.double(), w.double(), b.double())\n"
        "    err = (m.linear_bf16(x, w, b).double() - ref).abs()\n"
        "    assert (err <= 2 ** -7 * ref.abs() + 1e-6).all(), ((M, K, N), err.max())\n"
        "print('ok')\n")
    env = {**os.environ, "RAGGED_NATIVE_ISA": isa, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
