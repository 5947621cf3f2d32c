"""bench.gpu_serve off the GPU: its prompts, its table, and a clean exit without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench import gpu_serve


def test_prompts_are_reproducible_and_in_range() -> None:
    a, b = gpu_serve.prompts(5, 3, 20, 40), gpu_serve.prompts(5, 3, 20, 40)
    assert a == b and len(a) == 5 and all(20 <= len(p) <= 40 for p in a)
    assert gpu_serve.prompts(5, 4, 20, 40) != a


def test_markdown_reports_each_server_and_the_match() -> None:
    rows = [{"name": "decode graphs on", "startup_s": 61.2, "round1_s": 1.5, "round2_s": 2.0,
             "tracebacks": 0},
            {"name": "decode graphs off", "tracebacks": 1, "error": "server exited with code 1"}]
    report = {"device": "NVIDIA H200", "model": "/tmp/m", "profile": "uniform:0.3",
              "precision": "int4", "requests": 8, "max_new_tokens": 32, "servers": rows,
              "matching": 0, "same_outputs": False}
    table = gpu_serve.markdown(report)
    assert "| decode graphs on | 61 | 1.5 | 2.0 | 0 |  |" in table
    assert "| decode graphs off | 0 | 0.0 | 0.0 | 1 | server exited with code 1 |" in table
    assert "graphs on vs off: False (0 of 16)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_exits_cleanly_without_cuda(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.gpu_serve", "--model", "m", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "needs a CUDA device" in done.stdout
