"""A decoder layer's RMSNorm and rotary embedding on the CPU in one native call each.

Without sgl-kernel's CPU ops (the PyPI wheel is CUDA-only; compat/sgl_kernel_cpu.py), SGLang
0.5.23 runs RMSNorm and RotaryEmbedding on the CPU through their torch forms (`forward_native`):
a dozen small torch ops each, 16-20 us an RMSNorm and 40-45 us a rotary embedding at 1-8 rows
on a Zen 5, three of them a layer, about a tenth of a decode step of SmolLM2-135M at one request.
The AROUND hooks here run those same forms as one pass of the native kernels
(cuda_ext/elementwise.cpp): the rotary embedding bit for bit (every product and sum rounded to
the tensors' dtype, as torch's ops round them), RMSNorm with the residual bit for bit and its
output within one unit in the last place (the sum of squares is summed in another order).

A call the native form does not cover goes to SGLang's own: tensors off the CPU (the torch
fallback of scripts/gpu_serve.sh), RMSNorm's variants (cast_x_before_out_mul, fp32_residual,
var_hidden_size, override_orig_dtype, post_residual_addition, a residual of another dtype),
a rotary embedding with a precomputed `sin_cos_cache`, a compiled `apply_rotary_emb`, or a
cache narrower or wider than rotary_dim, and dtypes other than float32, bfloat16 and float16.

Like cpu_gemm, the plugin installs these hooks in every SGLang process of the environment, so a
stock server there runs the same norms as a ragged one. RAGGED_CPU_OPS picks (CHOICES).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sgl_ragged import native
from sgl_ragged.envs import env_choice

__all__ = ["CHOICES", "choice", "enabled", "rms_norm_native", "rotary_native", "validate"]

CHOICES = {
    "auto": "the native kernels where they are built, else SGLang's torch forms",
    "torch": "SGLang's torch forms (forward_native) throughout",
}

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def choice() -> str:
    return env_choice("RAGGED_CPU_OPS", CHOICES)


def validate() -> None:
    """Read RAGGED_CPU_OPS as every server of the environment will: a bad value is refused at
    startup, with the choices."""
    choice()


@functools.cache
def enabled() -> bool:
    """This process runs the native forms (RAGGED_CPU_OPS=auto and the kernels load)."""
    return choice() == "auto" and native.is_built() and native.available()


def rms_norm_native(original: Any, norm: Any, x: torch.Tensor,
                    residual: torch.Tensor | None = None,
                    post_residual_addition: torch.Tensor | None = None,
                    quant_linear: Any = None, **kwargs: Any) -> Any:
    """AROUND RMSNorm.forward_native: its default form on CPU tensors in one native pass
    (returns `x` or `(x, residual)`, new tensors, as the torch form does); else SGLang's."""
    if kwargs or not (enabled() and _plain_norm(norm, x, residual, post_residual_addition)):
        return original(norm, x, residual, post_residual_addition, quant_linear, **kwargs)
    out = native.load().rms_norm(x.contiguous(), None if residual is None
                                 else residual.contiguous(), norm.weight.data,
                                 norm.variance_epsilon)
    return out[0] if residual is None else (out[0], out[1])


def _plain_norm(norm: Any, x: torch.Tensor, residual: torch.Tensor | None,
                post: torch.Tensor | None) -> bool:
    weight = getattr(norm, "weight", None)
    return (post is None and x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() >= 1
            and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
            and weight.dtype in _DTYPES and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] == getattr(norm, "hidden_size", -1)
            and not getattr(norm, "cast_x_before_out_mul", True)
            and not getattr(norm, "fp32_residual", True)
            and getattr(norm, "variance_size_override", 0) is None
            and getattr(norm, "override_orig_dtype", 0) is None
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.device.type == "cpu")))


def rotary_native(original: Any, rope: Any, positions: torch.Tensor, query: torch.Tensor,
                  key: torch.Tensor, offsets: torch.Tensor | None = None,
                  fused_set_kv_buffer_arg: Any = None,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """AROUND RotaryEmbedding.forward_native: on CPU tensors in one native pass, bit for bit
    (new query and key of the inputs' shapes, as the torch form returns); else SGLang's."""
    if (not kwargs and fused_set_kv_buffer_arg is None and enabled()
            and _plain_rope(rope, positions, query, key)):
        pos = positions if offsets is None else positions + offsets
        pos = pos.flatten().to(torch.int64)
        if pos.numel() == query.shape[0]:
            q, k = native.load().rotary_embedding(pos, query, key, rope.cos_sin_cache,
                                                  rope.head_size, bool(rope.is_neox_style))
            return q, k
    return original(rope, positions, query, key, offsets, fused_set_kv_buffer_arg, **kwargs)


def _plain_rope(rope: Any, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> bool:
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    cache = getattr(rope, "cos_sin_cache", None)
    head = getattr(rope, "head_size", 0)
    return (not hasattr(rope, "sin_cos_cache")
            and getattr(rope, "_apply_rotary_emb_wrapped", None) is apply_rotary_emb
            and isinstance(cache, torch.Tensor) and cache.device.type == "cpu"
            and cache.dim() == 2 and cache.dtype in _DTYPES and cache.is_contiguous()
            and cache.shape[1] == getattr(rope, "rotary_dim", -1)
            and positions.device.type == "cpu"
            and query.device.type == key.device.type == "cpu"
            and query.dtype == key.dtype and query.dtype in _DTYPES
            and _heads_packed(query, head) and _heads_packed(key, head))


def _heads_packed(t: torch.Tensor, head: int) -> bool:
    """[T, heads * head] or [T, heads, head] whose token rows hold their heads contiguously."""
    if head <= 0 or t.stride(-1) != 1:
        return False
    if t.dim() == 2:
        return t.shape[1] % head == 0
    return t.dim() == 3 and t.shape[2] == head and t.stride(1) == head
