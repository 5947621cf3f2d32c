"""bfloat16 linear layers on a CPU without bfloat16 dot products (AVX2, AVX-512 without BF16).

SGLang 0.5.23 multiplies a dense layer's bfloat16 activations and weights with `F.linear` on a
CPU without AMX (`UnquantizedLinearMethod.apply`). Where the CPU has neither AMX nor
AVX512-BF16, torch converts both operands inside its product and reaches a fifth of its float32
speed (AMD EPYC with AVX2, one thread, a 256-token chunk through SmolLM2's dense layers:
11.1 s in bfloat16, 2.1 s converting to float32 first; docs/results.md, "Dense layers in
float32 on CPUs without bfloat16 dot products"). The AROUND hook here converts activations and
weights to float32 itself when a call has at least FLOAT32_ROWS rows (prefill chunks, large
decode batches) and rounds the product to bfloat16 once: the same sum of the same products,
accumulated in float32 as torch's bfloat16 product does, in another order. Below FLOAT32_ROWS
the conversion of the weights costs more than it saves, and the call stays as SGLang makes it.

It is installed by the plugin in every SGLang process of the environment, so a stock server
there (any --attention-backend) multiplies the same way as a ragged one: the benchmarks compare
KV caches, not matrix products. RAGGED_CPU_GEMM=float32|bfloat16 forces either way; unset or
auto picks float32 on CPUs whose flags show neither amx_bf16 nor avx512_bf16.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

FLOAT32_ROWS = 16
"""Calls with at least this many rows convert to float32 (python -m bench.cpu_gemm on an AMD
EPYC with AVX2, SmolLM2's dense layers, a model step's products at 2 threads: x0.38 at 1 row,
x1.03 at 8, x1.67 at 16, x2.45 at 32, x4.45 at 256; at 1 thread x1.42 at 8 rows)."""

CHOICES = ("auto", "float32", "bfloat16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from Linux's /proc/cpuinfo (empty elsewhere)."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return frozenset()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def float32_products() -> bool:
    """Whether bfloat16 linear layers of FLOAT32_ROWS rows or more multiply in float32 here."""
    choice = os.environ.get("RAGGED_CPU_GEMM", "auto") or "auto"
    if choice not in CHOICES:
        raise ValueError(f"RAGGED_CPU_GEMM={choice} is not a choice: set it to float32 (convert "
                         "bfloat16 linear layers to float32 products on the CPU), bfloat16 "
                         "(leave them to torch), or auto (float32 where the CPU has neither "
                         "amx_bf16 nor avx512_bf16)")
    if choice == "auto":
        return not {"amx_bf16", "avx512_bf16"} & cpu_flags()
    return choice == "float32"


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """This call is a CPU bfloat16 product of at least FLOAT32_ROWS rows with a plain weight."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and type(weight) in
            (torch.Tensor, torch.nn.Parameter) and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and x.numel() >= FLOAT32_ROWS * x.shape[-1]
            and (bias is None or bias.dtype == torch.bfloat16))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16(x @ weight^T + bias), the operands converted to float32 before the product."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def apply(original: Any, method: Any, layer: torch.nn.Module, x: torch.Tensor,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """AROUND UnquantizedLinearMethod.apply: float32 products where `takes` and the CPU wants
    them (`float32_products`, decided once per process), else SGLang's own call."""
    weight = getattr(layer, "weight", None)
    if (weight is not None and not getattr(layer, "use_intel_amx_backend", False)
            and takes(x, weight, bias) and _float32_here()):
        return linear(x, weight, bias)
    return original(method, layer, x, bias)


@functools.cache
def _float32_here() -> bool:
    return float32_products()
