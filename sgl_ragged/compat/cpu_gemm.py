"""bfloat16 dense layers on a CPU without bfloat16 dot products (AVX2, AVX-512 without BF16),
and decode batches on one with AVX512-BF16, with or without AMX.

SGLang 0.5.23 multiplies a dense layer's bfloat16 activations and weights with `F.linear` on a
CPU without AMX (`UnquantizedLinearMethod.apply`), and its logits with `torch.matmul` against
the bfloat16 lm_head (`LogitsProcessor._compute_lm_head`). Where the CPU has neither AMX nor
AVX512-BF16, torch converts both operands inside its product and reaches a fifth of its float32
speed (AMD EPYC with AVX2, one thread, a 256-token chunk through SmolLM2's dense layers: 11.1 s
in bfloat16, 2.1 s converting to float32 first; docs/results.md, "Dense layers in float32 on
CPUs without bfloat16 dot products"). The AROUND hooks here send such a call to the native
kernel (cuda_ext/linear.cpp): float32 sums of the same products that torch's bfloat16 product
accumulates, in another order, rounded to bfloat16 once. It reads the weight as bfloat16 and
widens it in registers (decode batches: converting the weight to float32 first costs more than
the product; 16 weights a load made float32 by a shift and a mask, 1-2 rows reading the weight
rows in memory order (docs/results.md, "Decode's weights read in memory order"), from 3 rows as
split quads: x1.2-2.0 on a model step at 3-12 rows, "Decode's dense layers in split quads"),
and from 21 rows multiplies float32 panels of it as outer products (prefill chunks:
x1.2-1.3 over converting both operands to float32 for torch's product at 256-512 rows;
docs/results.md, "Prefill's dense layers on the native kernel"). A weight or bias that is not
contiguous goes the float32 way (`linear`).

On a CPU with AVX512-BF16 (and no AMX), torch's own bfloat16 product is fast from a few dozen
rows but streams a decode batch's weights at half to two thirds of the speed of the native
kernel's vdpbf16ps dots (a Zen 5, 2 threads, spinning workers: x1.6-1.7 at 1-16 rows, x1.2 at
32-47; a Zen 4 since the dots prefetch in memory order: x2.2-3.8 at 1-16, x1.3-1.4 at 32-48,
x1.13 at 96-128; docs/results.md, "Decode rows on vdpbf16ps", "Decode's small products on both
cores" and "AVX512-BF16 dots' weights prefetched in memory order"), so there calls below the
kernel's `linear_dot_rows()` (128; 48 before session 66) go to the kernel and larger ones stay
torch's. With AMX, torch's product runs on the tiles and overtakes the dots sooner, but
a decode batch is still streamed faster by the dots (an Intel Xeon with AMX, 2 threads, SmolLM2's
model step: x2.2 at 1 row, x1.9 at 4, x1.4-1.5 at 8, x1.15 at 12, x0.89 at 16; its lm_head x1.7,
x1.6, x1.1-1.2, x0.9-0.94: docs/results.md, "Decode's dense layers on an AMX CPU"), so there
calls below AMX_DOT_ROWS (12) go to the kernel.

Without the native extension built, calls below FLOAT32_ROWS stay as SGLang makes them and
larger ones are converted to float32 (session 23's form, RAGGED_CPU_GEMM=float32).

The dots split a call over the native kernels' pool (cuda_ext/pool.cpp) from
`dot_serial_macs()` products: from 2^18 on the kernels' own pool, the default (its caller never
waits for a worker to wake, so a split costs at most about the call's time on one thread: served
decode x1.22 / 1.10 at 1 / 4 requests against 2^22 with OpenMP's workers asleep, docs/results.md
"The native kernels' own pool (session 67)"). Under RAGGED_NATIVE_POOL=openmp (torch's intra-op
pool) from 2^18 where OpenMP's idle workers spin at least SPLIT_SPIN iterations before they sleep
(libgomp's GOMP_SPINCOUNT and OMP_WAIT_POLICY, `omp_spin_count`; scripts/serve.sh's 3000), else
from 2^22, the kernel's default (a sleeping worker woken for each small product costs more than
the second core gives). RAGGED_DOT_SERIAL_MACS sets it outright.

The plugin installs the hooks in every SGLang process of the environment, so a stock server there
(any --attention-backend) multiplies the same way as a ragged one: the benchmarks compare KV
caches, not matrix products. RAGGED_CPU_GEMM picks the routes (CHOICES); unset or auto uses
them on CPUs whose flags show neither amx_bf16 nor avx512_bf16.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from sgl_ragged import native
from sgl_ragged.envs import env_choice
from sgl_ragged.native import cpu_flags
from sgl_ragged.native import pool as native_pool

__all__ = ["cpu_flags", "apply", "compute_lm_head", "linear", "route", "routes", "validate"]

SPLIT_SPIN = 3000
"""Under RAGGED_NATIVE_POOL=openmp, from this many spin iterations of OpenMP's idle workers, the
dots split calls from SERIAL_MACS_SPINNING products (a Zen 5, 2 threads, SmolLM2's model step
with GOMP_SPINCOUNT=3000: x1.34-1.46 at 1-4 rows, x1.07 at 8; with the workers asleep,
x0.73-0.83; the README's server x1.02-1.04 at 1-4 requests, where workers sleep again between
products; docs/results.md, "Decode's small products on both cores"). Smaller counts were not
measured and keep the default."""
SERIAL_MACS_SPINNING = 1 << 18
SERIAL_MACS_DEFAULT = 1 << 22  # linear.cpp's own default

AMX_DOT_ROWS = 12
"""On a CPU with AMX, calls below this many rows go to the native dots, larger ones to torch's
product on the tiles: where the lm_head's crossing (10-11 rows) and the model step's (about 15)
meet, the step's loss at 12-14 rows (x1.15-1.11 slower on the tiles) beside the lm_head's gain."""

FLOAT32_ROWS = 16
"""Without the native kernel, calls with at least this many rows convert to float32 (2 threads:
x0.38 at 1 row, x1.03 at 8, x1.67 at 16, x2.45 at 32, x4.45 at 256)."""

CHOICES = {
    "auto": "the native kernel where the CPU has neither amx_bf16 nor avx512_bf16; with "
            "avx512_bf16 and no amx_bf16 the native kernel for decode batches (below its "
            "linear_dot_rows()) and torch's bfloat16 product from there; with amx_bf16 the "
            "same below AMX_DOT_ROWS rows",
    "native": "the native kernel, on any CPU",
    "float32": "float32 from FLOAT32_ROWS rows, torch's bfloat16 product below",
    "bfloat16": "torch's bfloat16 product throughout (SGLang's own calls)",
}


def _choice() -> str:
    return env_choice("RAGGED_CPU_GEMM", CHOICES)


def routes() -> str:
    """How this process multiplies bfloat16 dense layers on the CPU: 'native' (the native
    kernel), 'decode' (the native kernel below `_decode_rows()`, torch's product from there),
    'float32' (float32 from FLOAT32_ROWS rows) or 'bfloat16' (torch's product). Raises
    ValueError for a bad RAGGED_CPU_GEMM, or for RAGGED_CPU_GEMM=native where the native
    extension is not built."""
    choice = _choice()
    if choice == "auto":
        flags = cpu_flags()
        if {"amx_bf16", "avx512_bf16"} & flags:
            return "decode" if _native_ready() and _dot_rows() > 0 else "bfloat16"
        return "native" if _native_ready() else "float32"
    if choice == "native" and not _native_ready():
        raise ValueError("RAGGED_CPU_GEMM=native needs the native kernels: build them with "
                         "`python -m sgl_ragged.native build`"
                         + (f" ({native.reason()})" if native.is_built() else "")
                         + ", or set RAGGED_CPU_GEMM=auto")
    return choice


def _native_ready() -> bool:
    """The native extension is built and loads. is_built first: a server never compiles it
    (scripts/env.sh builds it)."""
    return native.is_built() and native.available()


def _decode_rows() -> int:
    """Below how many rows route 'decode' sends a call to the native kernel: its
    linear_dot_rows(), and on a CPU with AMX no more than AMX_DOT_ROWS."""
    rows = _dot_rows()
    return min(rows, AMX_DOT_ROWS) if "amx_bf16" in cpu_flags() else rows


@functools.cache
def _dot_rows() -> int:
    """Below how many rows the native kernel multiplies on vdpbf16ps here (0: not at all, as
    under RAGGED_NATIVE_ISA=avx2)."""
    return int(native.load().linear_dot_rows())


def validate() -> None:
    """Read RAGGED_CPU_GEMM, RAGGED_DOT_SERIAL_MACS, RAGGED_NATIVE_POOL and GOMP_SPINCOUNT as
    every server of the environment will (server_args calls this at startup): a bad value is
    refused there, with what to set."""
    routes()
    dot_serial_macs()


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """'native' or 'float32' where this call is a CPU bfloat16 product with a plain weight that
    this process's routes take; None: leave it to SGLang."""
    if not (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() >= 1
            and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.dim() == 1))):
        return None
    mode = _routes_here()
    plain = weight.is_contiguous() and (bias is None or bias.is_contiguous())
    if mode == "native":
        return "native" if plain else "float32"
    rows = x.numel() // max(x.shape[-1], 1)
    if mode == "decode":
        return "native" if plain and rows < _decode_rows() else None
    if mode == "float32" and rows >= FLOAT32_ROWS:
        return "float32"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16(x @ weight^T + bias), the operands converted to float32 before the product."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            how: str) -> torch.Tensor:
    """bf16(x @ weight^T + bias) by route `how` ('native' or 'float32')."""
    if how == "native":
        return kernel().linear_bf16(x, weight, bias)
    return linear(x, weight, bias)


@functools.cache
def kernel() -> Any:
    """The native extension with its dots' split threshold set for this process
    (`dot_serial_macs`)."""
    module = native.load()
    module.set_linear_dot_serial_macs(dot_serial_macs())
    return module


def omp_spin_count(env: dict[str, str] | None = None) -> float:
    """How many iterations libgomp's idle workers spin before they sleep, as it reads the
    environment at start: GOMP_SPINCOUNT (a count with an optional k, M, G or T factor, or
    INFINITE / INFINITY) where set, else by OMP_WAIT_POLICY: 0 for PASSIVE, unbounded for
    ACTIVE, 300000 unset. ValueError for a value libgomp would not read."""
    env = os.environ if env is None else env
    count = env.get("GOMP_SPINCOUNT", "").strip()
    if count:
        if count.lower() in ("infinite", "infinity"):
            return math.inf
        factors = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
        factor = factors.get(count[-1].lower(), 1)
        digits = count[:-1] if factor != 1 else count
        if not digits.isdigit():
            raise ValueError(f"GOMP_SPINCOUNT={count} is not a spin count: a whole number, with "
                             "an optional k, M, G or T, or INFINITE")
        return int(digits) * factor
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    return {"passive": 0, "active": math.inf}.get(policy, 300000)


def dot_serial_macs(env: dict[str, str] | None = None) -> int:
    """Below how many products (rows x outputs x inputs) the native dots keep a call on one
    thread in this process: RAGGED_DOT_SERIAL_MACS where set, else SERIAL_MACS_SPINNING on the
    kernels' own pool (RAGGED_NATIVE_POOL, `native.pool.kind`) or where idle OpenMP workers spin
    at least SPLIT_SPIN iterations, else SERIAL_MACS_DEFAULT."""
    env = os.environ if env is None else env
    value = env.get("RAGGED_DOT_SERIAL_MACS", "").strip()
    if value:
        if not value.isdigit():
            raise ValueError(f"RAGGED_DOT_SERIAL_MACS={value} is not a count of products: set "
                             "a whole number (e.g. 262144), or unset it to follow the kernels' "
                             "pool and the OpenMP spin count")
        return int(value)
    spins = omp_spin_count(env)  # read (and refused where libgomp would not read it) either way
    if native_pool.kind(env) == "pool" or spins >= SPLIT_SPIN:
        return SERIAL_MACS_SPINNING
    return SERIAL_MACS_DEFAULT


def apply(original: Any, method: Any, layer: torch.nn.Module, x: torch.Tensor,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """AROUND UnquantizedLinearMethod.apply: this process's route (`route`), else SGLang's own
    call (AMX-packed layers, other dtypes, RAGGED_CPU_GEMM=bfloat16)."""
    weight = getattr(layer, "weight", None)
    if weight is not None and not getattr(layer, "use_intel_amx_backend", False):
        how = route(x, weight, bias)
        if how is not None:
            return product(x, weight, bias, how)
    return original(method, layer, x, bias)


def compute_lm_head(original: Any, processor: Any, hidden_states: torch.Tensor, lm_head: Any,
                    embedding_bias: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """AROUND LogitsProcessor._compute_lm_head: where SGLang would take its plain branch,
    `torch.matmul(hidden_states.to(weight.dtype), weight.T)` (no LoRA, no quantized or
    AMX-packed head, no float32 head, no RL on-policy target; that branch adds no
    embedding_bias), the same product by this process's route; else SGLang's own call."""
    weight = getattr(lm_head, "weight", None)
    if weight is not None:
        how = route(hidden_states, weight, None)
        if how is not None and _plain_lm_head(processor, lm_head):
            return product(hidden_states, weight, None, how)
    return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)


def _plain_lm_head(processor: Any, lm_head: Any) -> bool:
    from sglang.srt.layers import logits_processor

    if hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"):
        return False
    if logits_processor.should_apply_lm_head_quant_method(
            lm_head, getattr(lm_head, "quant_method", None)):
        return False
    return not (getattr(lm_head, "use_intel_amx_backend", False)
                or getattr(processor, "use_fp32_lm_head", False)
                or getattr(processor, "use_fp32_lm_head_output", False)
                or getattr(processor, "rl_on_policy_target", None) is not None)


@functools.cache
def _routes_here() -> str:
    return routes()
