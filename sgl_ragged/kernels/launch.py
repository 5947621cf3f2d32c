"""What every kernel launcher shares: block sizes and the row layout the kernels assume."""

from __future__ import annotations

import torch
import triton.language as tl

from sgl_ragged.kernels.tables import next_pow2, tl_dtype


def compiled_for_gpu(x: torch.Tensor) -> bool:
    """Whether kernels launched for tensors like x are GPU builds (tensor-core block sizes, dots
    in the model dtype, native fp8 conversion) rather than the CPU interpreter's small float32
    ones. bench.kernel_resources patches it to compile GPU builds on a machine without a GPU."""
    return x.is_cuda


def block_config(q: torch.Tensor, gsize: int, d: int) -> dict[str, object]:
    """Block sizes: tensor-core friendly on a GPU, tiny under the CPU interpreter (BLOCK_N 32:
    with 64 the sm_90 build of the split kernel spills registers at D = 128). Dot products
    run in q's dtype on a GPU and in float32 on the CPU (the interpreter's bfloat16 matmul is
    not numeric); float32 dots are exact (no TF32)."""
    gpu = compiled_for_gpu(q)
    dot = tl_dtype(q.dtype) if gpu else tl.float32
    return {
        "GSIZE": gsize, "D": d, "BLOCK_G": max(16, next_pow2(gsize)),
        "BLOCK_N": 32 if gpu else 16, "BLOCK_D": max(16, next_pow2(d)),
        "DOT": dot, "PRECISION": "ieee" if dot == tl.float32 else "tf32",
    }


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels assume head stride D and unit element stride; copy only if not."""
    d = x.shape[-1]
    return x if x.stride(-1) == 1 and x.stride(-2) == d else x.contiguous()
