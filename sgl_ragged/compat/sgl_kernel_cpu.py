"""Pure-torch stand-in for the CPU ops SGLang imports from ``sgl_kernel``.

The PyPI ``sglang-kernel`` wheel is CUDA-only: on a machine without libcuda,
``import sgl_kernel`` raises. SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``,
``--device cpu``) still imports a few ops from it at module import time, so without a
stand-in the scheduler cannot even start. :func:`install_if_needed` registers a small
module tree in ``sys.modules`` that mirrors the real package layout:

======================  =====================================================  ============
module                  names                                                  status
======================  =====================================================  ============
sgl_kernel.elementwise  rmsnorm, fused_add_rmsnorm, gemma_rmsnorm,             implemented
                        gemma_fused_add_rmsnorm, silu_and_mul, gelu_and_mul,
                        gelu_tanh_and_mul
sgl_kernel.kvcacheio    copy_all_layer_kv_cache_cpu                            implemented
sgl_kernel.speculative  assign_req_to_token_pool_cpu                           implemented
sgl_kernel.speculative  the other ``*_cpu`` ops of speculative decoding        stub
sgl_kernel.mamba        causal_conv1d_fn_cpu, causal_conv1d_update_cpu,        stub
                        chunk_gated_delta_rule_cpu
sgl_kernel.utils        is_arch_support_pdl (False: no programmatic launch)    implemented
sgl_kernel.graph        weak_ref_tensor (the tensor itself)                    implemented
sgl_kernel.sampling     top_k_renorm_prob, top_p_renorm_prob                   stub
sgl_kernel.moe          moe_sum, moe_sum_reduce                                stub
sgl_kernel.gemm         int8_scaled_mm                                         stub
sgl_kernel.quantization ggml_dequantize, ggml_moe_a8, ggml_mul_mat_a8,         stub
                        ggml_mul_mat_vec_a8
sgl_kernel.kvcacheio    the 13 ``transfer_kv_*`` ops of host KV offload        stub
torch.ops.sgl_kernel    5 ops Qwen3.5's CPU path binds at import (the Qwen-VL  stub
                        processor imports it): ``TORCH_OP_STUBS``
======================  =====================================================  ============

The last rows are the names a dense model's CUDA path imports at module level (SGLang
0.5.23: layernorm, activation, sampler, the Triton attention backend, quantization and
host-memory pool modules), for a lent GPU machine without the 1.2 GB sgl-kernel wheel
(scripts/gpu_serve.sh; docs/gpu_serving.md). There the server runs with
``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` (norms, activations and rotary embedding on their
torch ``forward_native``), ``--sampling-backend pytorch`` (no FlashInfer sampling) and
``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1``; the norms and activations above work on CUDA
tensors too.

``sgl_kernel`` itself re-exports every name. Stubs raise ``NotImplementedError`` naming
the op. Any other name or submodule (``sgl_kernel.scalar_type``, ``sgl_kernel.allreduce``)
is absent, so importing it raises ``ImportError`` and SGLang takes its own fallback, as it
does when the package is missing. ``torch.ops.sgl_kernel`` holds only the stubs of
``TORCH_OP_STUBS``, which keeps SGLang's AMX fast paths (``cpu_has_amx_support()``, which asks
for ``convert_weight_packed``) off.

Importing this module changes nothing; only :func:`install_if_needed` does, or, in
every process of the project venv, the import hook that ``scripts/env.sh`` installs as a
``.pth`` file (compat/import_hook.py): it resolves the first ``import sgl_kernel`` to the real
package or, if that raises, to the stand-in.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import logging
import sys
import types
from collections.abc import Callable
from importlib.machinery import ModuleSpec, PathFinder

import torch
import torch.nn.functional as F

from sgl_ragged.compat.import_hook import DUAL_GEMM, gpu_only_spec

logger = logging.getLogger(__name__)

STANDIN_FLAG = "__sgl_ragged_standin__"


# --- elementwise: norms (math in float32, like the FlashInfer / CPU kernels) -------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """``x / RMS(x) * w`` over the last dim in float32; ``w = weight + 1`` for Gemma."""
    xf = x.float()
    w = weight.float() + 1.0 if gemma else weight.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def _store(result: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result.to(like.dtype)
    out.copy_(result)
    return out


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out = input / RMS(input) * weight`` (written into ``out`` if given)."""
    return _store(_rms(input, weight, eps, gemma=False), input, out)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out = input / RMS(input) * (weight + 1)`` (written into ``out`` if given)."""
    return _store(_rms(input, weight, eps, gemma=True), input, out)


def _fused_add(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
) -> None:
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_rms(total, weight, eps, gemma))


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``; ``input = rmsnorm(residual) * weight``."""
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``; ``input = rmsnorm(residual) * (weight + 1)``."""
    _fused_add(input, residual, weight, eps, gemma=True)


# --- elementwise: gated activations ``act(x[..., :d]) * x[..., d:]`` ----------------------


def _act_and_mul(
    act: Callable[[torch.Tensor], torch.Tensor], input: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    d = input.shape[-1] // 2
    if out is not None and (out.shape[:-1] != input.shape[:-1] or out.shape[-1] != d):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(*input.shape[:-1], d)}")
    xf = input.float()
    return _store(act(xf[..., :d]) * xf[..., d:], input, out)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` (exact erf GELU)."""
    return _act_and_mul(F.gelu, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]``."""
    return _act_and_mul(lambda x: F.gelu(x, approximate="tanh"), input, out)


# --- kvcacheio ---------------------------------------------------------------------------


def _rows_at(address: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """A ``[num_rows, row_bytes]`` uint8 view (no copy) of the memory at ``address``."""
    raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every KV buffer ``b``: ``buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]``.

    ``data_ptrs`` [num_bufs] uint64 base addresses, ``strides`` [num_bufs] int64 bytes per
    slot row; ``tgt_loc``/``src_loc`` [num_locs] int32/int64 slot indices. All source rows
    of a buffer are gathered before any target row is written, so overlapping locations
    are safe (as in the real kernel).
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError("copy_all_layer_kv_cache_cpu: tgt_loc and src_loc differ in length")
    if tgt_loc.numel() == 0 or data_ptrs.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    mask64 = (1 << 64) - 1
    for address, row_bytes in zip(
        data_ptrs.view(torch.int64).tolist(), strides.tolist(), strict=True
    ):
        rows = _rows_at(address & mask64, int(row_bytes), num_rows)
        rows[tgt] = rows[src]  # advanced indexing on the right gathers a copy first


# --- speculative -------------------------------------------------------------------------


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[p[i]:p[i+1]]``.

    ``req_to_token`` [max_reqs, pool_len] int32 (written in place); ``out_cache_loc``
    int64 logical slots, packed per request in batch order (``p`` is the exclusive
    prefix sum of ``end - start``); the other tensors [bs] int32/int64.
    """
    if req_to_token.dtype != torch.int32 or out_cache_loc.dtype != torch.int64:
        raise TypeError(
            "assign_req_to_token_pool_cpu: needs int32 req_to_token, int64 out_cache_loc"
        )
    lens = (end_offset.long() - start_offset.long()).clamp_min(0)
    total = int(lens.sum())
    if total == 0:
        return
    # Flat position in req_to_token of every new token, in batch order.
    row_base = torch.repeat_interleave(
        req_pool_indices.long() * pool_len + start_offset.long(), lens
    )
    first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    flat = row_base + torch.arange(total) - first
    req_to_token.view(-1)[flat] = out_cache_loc[:total].to(torch.int32)


# --- the CUDA path's launch helpers ------------------------------------------------------


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch: off (the stand-in launches no CUDA kernels)."""
    return False


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """CUDA-graph capture's weak reference: the tensor itself (a strong reference)."""
    return tensor


# --- stubs -------------------------------------------------------------------------------


def _stub(name: str, why: str) -> Callable[..., None]:
    """A function that raises NotImplementedError naming the missing op."""

    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: the real sgl_kernel could not be imported "
            f"on this machine and sgl_ragged's pure-torch stand-in does not implement it "
            f"({why})."
        )

    op.__name__ = op.__qualname__ = name
    return op


_SPEC_WHY = "speculative decoding on CPU needs the real sgl_kernel"
_MAMBA_WHY = "hybrid linear-attention (Mamba/GDN/KDA) models on CPU need the real sgl_kernel"
_SPECULATIVE_STUBS = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)
_MAMBA_STUBS = ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu")
_CUDA_WHY = {
    "sampling": "FlashInfer-style sampling; serve with --sampling-backend pytorch",
    "moe": "mixture-of-experts models need the real sgl_kernel",
    "gemm": "int8 weight quantization needs the real sgl_kernel",
    "quantization": "GGUF-quantized weights on a GPU need the real sgl_kernel",
    "kvcacheio": "host KV offload (hierarchical cache) needs the real sgl_kernel",
}
_KV_TRANSFER_STUBS = tuple(f"transfer_kv_{name}" for name in (
    "all_layer", "all_layer_direct_lf_pf", "all_layer_lf_pf", "all_layer_lf_ph",
    "all_layer_mla", "all_layer_mla_lf_pf", "direct", "per_layer", "per_layer_direct_pf_lf",
    "per_layer_mla", "per_layer_mla_pf_lf", "per_layer_pf_lf", "per_layer_ph_lf"))

IMPLEMENTED: dict[str, tuple[Callable[..., object], ...]] = {
    "elementwise": (
        rmsnorm,
        fused_add_rmsnorm,
        gemma_rmsnorm,
        gemma_fused_add_rmsnorm,
        silu_and_mul,
        gelu_and_mul,
        gelu_tanh_and_mul,
    ),
    "kvcacheio": (copy_all_layer_kv_cache_cpu,),
    "speculative": (assign_req_to_token_pool_cpu,),
    "utils": (is_arch_support_pdl,),
    "graph": (weak_ref_tensor,),
}
STUBBED: dict[str, tuple[str, ...]] = {
    "speculative": _SPECULATIVE_STUBS,
    "mamba": _MAMBA_STUBS,
    "sampling": ("top_k_renorm_prob", "top_p_renorm_prob"),
    "moe": ("moe_sum", "moe_sum_reduce"),
    "gemm": ("int8_scaled_mm",),
    "quantization": ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"),
    "kvcacheio": _KV_TRANSFER_STUBS,
}


# ``torch.ops.sgl_kernel`` names some SGLang modules bind at import time on a CPU (SGLang
# 0.5.23's qwen3_5, which the Qwen-VL multimodal processor imports for its model classes): each
# is registered with a one-tensor schema that raises NotImplementedError when called, so the
# modules import and only a model that runs the op fails. None of them is `convert_weight_packed`,
# whose presence turns SGLang's AMX CPU backend on (`cpu_has_amx_support`), nor another name
# SGLang probes with hasattr to pick a fast path.
_HYBRID_WHY = "hybrid linear-attention Qwen3.5 models on CPU need the real sgl_kernel"
TORCH_OP_STUBS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_input_proj_cpu",
)
_LIBRARIES: list[object] = []  # torch.library.Library objects unregister when collected


def _register_torch_op_stubs() -> None:
    import torch

    if all(hasattr(torch.ops.sgl_kernel, name) for name in TORCH_OP_STUBS):
        return
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in TORCH_OP_STUBS:
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        library.define(f"{name}(Tensor x) -> ()")
        library.impl(name, _stub(name, _HYBRID_WHY), "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


# --- installation ------------------------------------------------------------------------

# What a failing `import sgl_kernel` raises here (libcuda.so.1 missing: ImportError).
_LOAD_ERRORS = (ImportError, OSError, RuntimeError)
_DOC = "sgl_ragged's pure-torch stand-in for sgl_kernel (see sgl_ragged.compat.sgl_kernel_cpu)."


def _submodule(sub: str) -> types.ModuleType:
    """``sgl_kernel.<sub>`` holding its implemented ops and stubs."""
    module = types.ModuleType(f"sgl_kernel.{sub}", _DOC)
    setattr(module, STANDIN_FLAG, True)
    why = {"speculative": _SPEC_WHY, "mamba": _MAMBA_WHY, **_CUDA_WHY}.get(sub, "")
    for func in IMPLEMENTED.get(sub, ()):
        setattr(module, func.__name__, func)
    for name in STUBBED.get(sub, ()):
        setattr(module, name, _stub(name, why))
    return module


def _turn_into_standin(root: types.ModuleType) -> None:
    """Make ``root`` (already or about to be ``sys.modules['sgl_kernel']``) the stand-in.

    Drops whatever a failed import of the real package left behind: its half-imported
    submodules in ``sys.modules`` and the names its ``__init__`` had bound on ``root``.
    """
    for name in [m for m in sys.modules if m.startswith("sgl_kernel.")]:
        del sys.modules[name]
    for name in [n for n in vars(root) if not n.startswith("__")]:
        delattr(root, name)
    root.__doc__ = _DOC
    root.__path__ = []  # a package, so unknown submodules raise ModuleNotFoundError
    setattr(root, STANDIN_FLAG, True)
    for sub in sorted({*IMPLEMENTED, *STUBBED}):
        module = _submodule(sub)
        sys.modules[module.__name__] = module
        setattr(root, sub, module)
        for name, value in vars(module).items():
            if callable(value) and not name.startswith("__"):
                setattr(root, name, value)
    sys.modules["sgl_kernel"] = root
    _register_torch_op_stubs()


def is_standin_installed() -> bool:
    """True if ``sys.modules['sgl_kernel']`` is this stand-in."""
    return getattr(sys.modules.get("sgl_kernel"), STANDIN_FLAG, False)


def _real_sgl_kernel_error() -> Exception | None:
    """Try the real ``import sgl_kernel``; return the error, or None if it loaded."""
    try:
        import sgl_kernel  # noqa: F401
    except _LOAD_ERRORS as e:
        return e
    return None


def install_if_needed() -> bool:
    """Install the stand-in unless the real ``sgl_kernel`` imports; True if it is active.

    Idempotent. On a GPU machine (real import succeeds) nothing changes and the result is
    False. Must run before any SGLang module that imports ``sgl_kernel`` at import time;
    in processes spawned by SGLang that is earlier than plugins load, hence the import
    hook below.
    """
    if is_standin_installed():
        return True
    error = _real_sgl_kernel_error()
    if error is None:  # loaded: the real package, or the stand-in via the import hook
        return is_standin_installed()
    _turn_into_standin(types.ModuleType("sgl_kernel"))
    logger.info("sgl_kernel unavailable (%s); using sgl_ragged's pure-torch stand-in", error)
    return True


# --- startup import hook -----------------------------------------------------------------
# SGLang's scheduler and detokenizer, where spawned, import
# sglang.srt.mem_cache.memory_pool (which imports sgl_kernel) while unpickling their
# target, before they load plugins; install_if_needed() from the plugin is too late there.
# So the venv's startup hook (compat/import_hook.py, a .pth file scripts/env.sh writes) calls
# find_spec() below on the first `import sgl_kernel` (and of DUAL_GEMM).


class _RealOrStandInLoader(importlib.abc.Loader):
    """Executes the real ``sgl_kernel``; if that fails, turns the module into the stand-in."""

    def __init__(self, real: ModuleSpec | None) -> None:
        self.real = real

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            if self.real is None or self.real.loader is None:
                raise ImportError("sgl_kernel is not installed")
            self.real.loader.exec_module(module)
        except _LOAD_ERRORS as e:
            _turn_into_standin(module)
            logger.info("sgl_kernel unavailable (%s); using sgl_ragged's stand-in", e)


class _RealOrDualGemmStandInLoader(importlib.abc.Loader):
    """Executes SGLang's real CuTe DSL dual GEMM module; if CUTLASS's DSL is missing, fills
    the module from compat.dual_gemm instead (no dual GEMM)."""

    def __init__(self, real: ModuleSpec | None) -> None:
        self.real = real

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            if self.real is None or self.real.loader is None:
                raise ImportError(f"{DUAL_GEMM} is not installed")
            self.real.loader.exec_module(module)
        except ImportError as e:
            from sgl_ragged.compat import dual_gemm

            for name in [n for n in vars(module) if not n.startswith("__")]:
                delattr(module, name)
            for name, value in vars(dual_gemm).items():
                if not name.startswith("__"):
                    setattr(module, name, value)
            setattr(module, STANDIN_FLAG, True)
            logger.info("%s unavailable (%s); no dual GEMM (sgl_ragged.compat.dual_gemm)",
                        DUAL_GEMM, e)


def find_spec(name: str, path: list[str] | None = None) -> ModuleSpec | None:
    """Spec for ``sgl_kernel`` or ``DUAL_GEMM``: the real module, a stand-in where it fails
    to import; for a package of import_hook.GPU_ONLY, a failing import where it is skipped now
    (the .pth line of session 54 sent those names here; today's sends them to
    import_hook.gpu_only_spec directly); None for other names.

    ``path`` is where to look for the real module (default: ``sys.path``; for DUAL_GEMM its
    parent package's ``__path__``, as the import system passes it).
    """
    if name == DUAL_GEMM:
        real = PathFinder.find_spec(name, path)
        spec = ModuleSpec(name, _RealOrDualGemmStandInLoader(real))
        if real is not None:
            spec.origin, spec.has_location = real.origin, real.has_location
        return spec
    if name != "sgl_kernel":
        return gpu_only_spec(name)
    real = PathFinder.find_spec(name, path)
    spec = ModuleSpec(name, _RealOrStandInLoader(real), is_package=True)
    if real is not None:
        spec.origin = real.origin
        spec.has_location = real.has_location
        spec.submodule_search_locations = real.submodule_search_locations
    return spec

