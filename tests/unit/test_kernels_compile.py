"""Every Triton kernel compiles for an H100 (sm_90) on this machine, for every row precision.

Triton's interpreter runs code the GPU compiler refuses (DEVELOPERS.md: a pointer type bound
to a local variable passed the CPU tests and failed on the H100), so the interpreter tests
alone do not show that a kernel builds. bench.kernel_resources compiles each kernel as the JIT
would for sm_90, with ptxas, in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sgl_ragged.precision import PRECISION_CHOICES

PRECISIONS = [*PRECISION_CHOICES, "int8+int4", "fp8+int2", "int8+fp8"]  # pairs: a quantized high tier

ROOT = Path(__file__).parents[2]
KERNELS = {"decode split", "decode tail", "decode merge", "extend", "seal"}


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--arch", "90", "--head-dim", "64",
         "--precision", *PRECISIONS, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    builds = json.loads((tmp_path / "kernel_resources.json").read_text())["builds"]
    built = {(b["kernel"], b["precision"]) for b in builds}
    assert built == {(k, p) for k in KERNELS for p in PRECISIONS}
    for b in builds:
        assert 0 < b["registers"] <= 255, b
        assert b["programs_per_sm"] >= 1, b
