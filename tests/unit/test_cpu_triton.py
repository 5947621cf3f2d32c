"""compat/cpu_triton.py: the torch form of Qwen2-MoE's shared-expert gate against SGLang's own
Triton kernel (run by Triton's interpreter, in a child process: the kernel must be decorated
under TRITON_INTERPRET=1) and against a per-token loop in float64."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sgl_ragged.compat.cpu_triton import gate_sigmoid_mul

# (tokens, hidden): one token, a batch, a hidden size that is no power of two (the kernel's
# block is masked there)
SHAPES = ((1, 64), (5, 64), (33, 100))


def _never(*args, **kwargs):
    raise AssertionError("CPU tensors went to the Triton kernel")


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, w, s, f = (torch.randn(*shape, generator=g).to(dtype)
                  for shape in ((tokens, hidden), (hidden,), (tokens, hidden), (tokens, hidden)))
    return h, w / hidden ** 0.5, s, f


@pytest.mark.parametrize("do_add", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_gate_matches_a_per_token_loop(tokens, hidden, dtype, do_add):
    h, w, s, f = _inputs(tokens, hidden, dtype, seed=tokens * hidden)
    out = f.clone()
    gate_sigmoid_mul(_never, h, w, s, out, do_add=do_add)
    for t in range(tokens):
        dot = sum(float(h[t, i]) * float(w[i]) for i in range(hidden))
        gate = 1.0 / (1.0 + torch.exp(torch.tensor(-dot, dtype=torch.float64)))
        want = gate * s[t].double() + (f[t].double() if do_add else 0.0)
        # float32: the dot's summation order; bfloat16: the one rounding of the result
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(out[t].double(), want, rtol=tol, atol=tol)


def test_tensors_off_the_cpu_go_to_the_kernel():
    calls = []
    h, w, s, f = (t.to("meta") for t in _inputs(2, 8, torch.float32, seed=0))
    gate_sigmoid_mul(lambda *a, **k: calls.append(k), h, w, s, f, do_add=True)
    assert calls == [{"do_add": True}]


def test_shapes_that_do_not_agree_are_refused():
    h, w, s, f = _inputs(3, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"gate weight \(15,\).*want \[T, H\], \[H\]"):
        gate_sigmoid_mul(_never, h, w[:15], s, f, do_add=True)


_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from sgl_ragged.compat.sgl_kernel_cpu import install_if_needed
    install_if_needed()
    from sglang.kernels.ops.elementwise import elementwise
    from sgl_ragged.compat.cpu_triton import gate_sigmoid_mul
    from tests.unit.test_cpu_triton import SHAPES, _inputs, _never
    assert type(elementwise._fused_gate_sigmoid_mul_add_kernel).__name__ == "InterpretedFunction"
    diffs = {}
    for tokens, hidden in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for do_add in (True, False):
                h, w, s, f = _inputs(tokens, hidden, dtype, seed=tokens + hidden)
                ours, kernel = f.clone(), f.clone()
                gate_sigmoid_mul(_never, h, w, s, ours, do_add=do_add)
                elementwise._launch_fused_gate_sigmoid_mul(h, w, s, kernel, do_add=do_add)
                key = f"{tokens}x{hidden} {dtype} add={do_add}"
                scale = kernel.float().abs().clamp(min=1.0)
                diffs[key] = ((ours.float() - kernel.float()).abs() / scale).max().item()
    print(json.dumps(diffs))
""")


def test_gate_matches_sglang_triton_kernel():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(diffs) == len(SHAPES) * 4
    for key, diff in diffs.items():
        # relative to the output (at least 1): both compute in float32 and round once, so
        # float32 parts only by the dot's order, and a bfloat16 output by at most one unit in
        # its last place (2^-7 relative; the interpreter rounds bfloat16 its own way)
        assert diff <= (1e-6 if "float32" in key else 2 ** -7), (key, diff)
