"""Stand-in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` where CUTLASS's Python DSL
(``cutlass``, the nvidia-cutlass-dsl wheels) is not installed.

SGLang 0.5.23 builds a ``DualGemm`` for every dense MLP on CUDA, and its constructor
imports this module to ask whether the fused gate/up SwiGLU kernel applies. That kernel is
Blackwell-only (SM100, tcgen05), so on any other GPU the answer is no; but the real module
imports ``cutlass`` at its top, which a lent GPU machine without those wheels lacks
(scripts/gpu_serve.sh; docs/gpu_serving.md), and the model cannot even be built. This module
answers the same question without CUTLASS: no dual GEMM, so the MLP runs its plain gate/up
projection. ``sgl_kernel_cpu.find_spec`` loads the real module first and this one only when
that raises ``ImportError``.
"""

from __future__ import annotations

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    """The real module's modes, same names and values (the modeling layer picks one before
    asking `can_use_dual_gemm`)."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens: int, hidden_size: int, intermediate_size: int,
                      quant_mode: DualGemmQuantMode) -> bool:
    """False: the fused kernel needs CUTLASS's DSL, which is not installed."""
    return False


def _unavailable(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("the CuTe DSL dual GEMM needs CUTLASS's Python DSL (cutlass), "
                              "which is not installed; can_use_dual_gemm() is False here")


dual_gemm_swiglu = dual_gemm_swiglu_fp8 = _unavailable
