"""`--ragged-attention` names -> attention implementations, and the choice for `auto`.

The implementations are imported only when built (the Triton one imports Triton, the native one
loads the C++ extension built by sgl_ragged/native).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from sgl_ragged.precision import FULL_PRECISION, MIXED_PRECISION

if TYPE_CHECKING:
    from sgl_ragged.attention_backend.impl import AttentionImpl
    from sgl_ragged.mem_pool.storage import RaggedStorage
    from sgl_ragged.profile import BudgetProfile

logger = logging.getLogger(__name__)


def triton_refuses(head_dim: int, precision: str) -> str | None:
    """Why the Triton kernels cannot serve rows of this head size and --ragged-precision
    (they pack low-tier codes planar in registers: a power-of-two head size), or None."""
    if precision == FULL_PRECISION:
        return None
    if head_dim & (head_dim - 1):
        return f"packs low-tier codes for power-of-two head sizes only, not {head_dim}"
    return None


HIGH_TIER_READERS = ("reference", "triton", "batched", "native")
"""--ragged-attention paths that read a quantized high tier (--ragged-precision H+L)."""

MIXED_FORMAT_READERS = ("reference", "batched", "native", "triton")
"""--ragged-attention paths that read a low format per head group (--ragged-precision mixed)."""


def _reference(storage: RaggedStorage, profile: BudgetProfile | None,
               num_q_heads: int | None) -> AttentionImpl:
    from sgl_ragged.attention_backend.torch_ref import TorchAttention

    return TorchAttention(storage)


def _batched(storage: RaggedStorage, profile: BudgetProfile | None,
             num_q_heads: int | None) -> AttentionImpl:
    from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention

    return BatchedTorchAttention(storage)


def _native(storage: RaggedStorage, profile: BudgetProfile | None,
            num_q_heads: int | None) -> AttentionImpl:
    from sgl_ragged import native
    from sgl_ragged.attention_backend.native_impl import NativeAttention

    if not native.available():
        raise ValueError(f"--ragged-attention native: {native.reason()}; build them with "
                         "`python -m sgl_ragged.native build` (scripts/env.sh does), or use "
                         "--ragged-attention batched")
    return NativeAttention(storage)


def _cpu_choice(storage: RaggedStorage) -> str:
    """auto on the CPU: native where the kernels are built and serve this cache, else batched
    (one log line saying why)."""
    from sgl_ragged import native
    from sgl_ragged.attention_backend.native_impl import native_refuses

    refused = native_refuses(storage)
    if refused is None and native.available():
        return "native"
    why = refused or native.reason()
    logger.warning("ragged attention: auto uses the batched torch path, the native kernels "
                   "are unavailable: %s", why)
    return "batched"


def _triton(storage: RaggedStorage, profile: BudgetProfile | None,
            num_q_heads: int | None) -> AttentionImpl:
    if storage.device.type != "cuda":
        raise ValueError(f"--ragged-attention triton needs a CUDA device, the KV cache is on "
                         f"{storage.device.type}; use auto, batched or reference")
    from sgl_ragged.attention_backend.triton_impl import TritonAttention

    return TritonAttention(storage, profile_split_ratios(storage, profile), num_q_heads=num_q_heads)


IMPLEMENTATIONS: dict[str, Callable[[RaggedStorage, BudgetProfile | None, int | None],
                                    AttentionImpl]] = {
    "reference": _reference,
    "batched": _batched,
    "native": _native,
    "triton": _triton,
}
"""--ragged-attention name -> builder (storage, resolved profile, query heads per rank)."""


def make_attention_impl(storage: RaggedStorage, profile: BudgetProfile | None,
                        choice: str = "auto", num_q_heads: int | None = None) -> AttentionImpl:
    """The implementation `choice` names (config.ATTENTION_IMPLS); auto = the Triton kernels on
    CUDA, the native kernels on the CPU where they are built and read the layout (else batched
    torch), and the reference for the dynamic reference mode (its
    per-head keep masks are a reference feature no other implementation reads). num_q_heads
    (per rank) lets the Triton path measure its decode kernel's occupancy."""
    dynamic = storage.row_keep is not None
    if dynamic and choice not in ("auto", "reference"):
        raise ValueError(f"--ragged-attention {choice} does not support the dynamic reference "
                         "mode (profile dynamic:<rho>); use auto or reference")
    layout = storage.layout
    refused = triton_refuses(layout.head_dim, layout.precision_name)
    if choice == "auto":
        if dynamic:
            choice = "reference"
        elif storage.device.type == "cuda" and refused:
            logger.warning("ragged attention: auto uses the batched torch path: "
                           "--ragged-attention triton %s", refused)
            choice = "batched"
        elif storage.device.type == "cuda":
            choice = "triton"
        else:
            choice = _cpu_choice(storage)
    if layout.high is not None and choice in IMPLEMENTATIONS and choice not in HIGH_TIER_READERS:
        raise ValueError(f"--ragged-attention {choice} does not read a quantized high tier yet; "
                         f"use --ragged-attention batched (or auto) with --ragged-precision "
                         f"{layout.precision_name}")
    if layout.mixed_formats and choice in IMPLEMENTATIONS and choice not in MIXED_FORMAT_READERS:
        raise ValueError(f"--ragged-attention {choice} reads one low-tier format, but the profile "
                         f"has one per head group (--ragged-precision {MIXED_PRECISION}); use "
                         f"--ragged-attention batched (or auto, or reference)")
    if choice == "triton" and refused:
        raise ValueError(f"--ragged-attention triton {refused}; use --ragged-attention batched "
                         f"(or auto) with --ragged-precision {layout.low.name}")
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"--ragged-attention {choice!r} is unknown; choose one of "
                         f"{['auto', *IMPLEMENTATIONS]}")
    return IMPLEMENTATIONS[choice](storage, profile, num_q_heads)


def profile_split_ratios(storage: RaggedStorage,
                         profile: BudgetProfile | None) -> tuple[tuple[float, ...], ...]:
    """[L][G] split ratios of the profile (computed from its budgets if it stores none), the
    layout's shares of bytes read per page without a profile, and equal shares where a tier is
    quantized. The Triton split kernel spends about as long on an int4 token as on a
    full-precision one and pays a fold per page, so neither slots nor bytes weigh its work:
    on an H200 equal shares (uniform splits) beat byte-weighted ones for int4 rows at every
    measured shape and launch, by up to 42% (docs/results.md, "Decode attention on an H200")."""
    from sgl_ragged import budgets
    from sgl_ragged.kernels.aot import layout_split_ratios

    layout = storage.layout
    if layout.quantized:
        return tuple((1 / len(groups),) * len(groups) for groups in layout.groups)
    if profile is None or tuple(map(tuple, profile.groups)) != tuple(map(tuple, layout.groups)):
        return layout_split_ratios(layout)
    return profile.split_ratios or budgets.split_ratios(profile.budgets, profile.groups)
