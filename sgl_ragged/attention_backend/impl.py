"""Attention implementations behind the backend: one layer, the whole batch (DESIGN.md s. 7).

`AttentionImpl` is the seam: the torch reference (any device; the oracle), batched torch
(`batched_torch.BatchedTorchAttention`, the CPU default) and the Triton kernels
(`triton_impl.TritonAttention`, the CUDA default) all attend over sealed rows + staged tail +
new tokens, then stage and seal the tail of every request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata
from sgl_ragged.attention_backend.torch_ref import request_forward
from sgl_ragged.mem_pool.quant import FULL_PRECISION
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import BudgetProfile

TRITON_LOW_TIERS = True
"""Whether the Triton kernels read rows with a low-precision tier (--ragged-precision)."""


def triton_refuses(head_dim: int, precision: str) -> str | None:
    """Why the Triton kernels cannot serve rows of this head size and --ragged-precision
    (they pack low-tier codes planar in registers: a power-of-two head size), or None."""
    if precision == FULL_PRECISION:
        return None
    if not TRITON_LOW_TIERS:
        return "does not read low-precision tiers yet"
    if head_dim & (head_dim - 1):
        return f"packs low-tier codes for power-of-two head sizes only, not {head_dim}"
    return None


class AttentionImpl(ABC):
    """One layer's ragged attention for a planned batch, with the tail's staging and sealing."""

    def __init__(self, storage: RaggedStorage) -> None:
        self.storage = storage

    @abstractmethod
    def prepare(self, meta: RaggedForwardMetadata) -> None:
        """Once per forward, after planning: build what every layer's call reads (into meta)."""

    @abstractmethod
    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        """q: [N, H_q, D]; k, v: [N, H, D] this forward's tokens (rows of the requests in
        meta, in order). Returns [N, H_q, D] in q's dtype."""


class TorchAttention(AttentionImpl):
    """The torch reference, request by request (torch_ref.request_forward)."""

    def prepare(self, meta: RaggedForwardMetadata) -> None:
        """Nothing: the reference reads the request plans directly."""

    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        out = torch.empty_like(q)
        for plan in meta.requests:
            rows = slice(plan.q_start, plan.q_start + plan.q_len)
            out[rows] = request_forward(self.storage, layer, plan, q[rows], k[rows], v[rows], scale)
        return out


def make_attention_impl(storage: RaggedStorage, profile: BudgetProfile | None,
                        choice: str = "auto", num_q_heads: int | None = None) -> AttentionImpl:
    """The implementation `choice` names (config.ATTENTION_IMPLS); auto = the Triton kernels on
    CUDA, batched torch elsewhere, and the reference for the dynamic reference mode (its
    per-head keep masks are a reference feature no other implementation reads). num_q_heads
    (per rank) lets the Triton path measure its decode kernel's occupancy."""
    dynamic = storage.row_keep is not None
    if dynamic and choice not in ("auto", "reference"):
        raise ValueError(f"--ragged-attention {choice} does not support the dynamic reference "
                         "mode (profile dynamic:<rho>); use auto or reference")
    layout = storage.layout
    refused = triton_refuses(layout.head_dim, layout.low.name) if layout.low else None
    if choice == "auto":
        cuda = storage.device.type == "cuda" and not refused
        choice = "reference" if dynamic else "triton" if cuda else "batched"
    if choice == "triton" and refused:
        raise ValueError(f"--ragged-attention triton {refused}; use --ragged-attention batched "
                         f"(or auto) with --ragged-precision {layout.low.name}")
    if choice == "reference":
        return TorchAttention(storage)
    if choice == "batched":
        from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention

        return BatchedTorchAttention(storage)
    if storage.device.type != "cuda":
        raise ValueError(f"--ragged-attention triton needs a CUDA device, the KV cache is on "
                         f"{storage.device.type}; use auto, batched or reference")
    from sgl_ragged.attention_backend.triton_impl import TritonAttention

    return TritonAttention(storage, profile_split_ratios(storage, profile), num_q_heads=num_q_heads)


def profile_split_ratios(storage: RaggedStorage,
                         profile: BudgetProfile | None) -> tuple[tuple[float, ...], ...]:
    """[L][G] split ratios of the profile (computed from its budgets if it stores none), or
    the layout's shares of bytes read per page without a profile or with a low tier (the
    profile's ratios count full-precision slots, a quantized row's bytes are its tiers')."""
    from sgl_ragged import budgets
    from sgl_ragged.kernels.aot import layout_split_ratios

    layout = storage.layout
    if (profile is None or layout.quantized
            or tuple(map(tuple, profile.groups)) != tuple(map(tuple, layout.groups))):
        return layout_split_ratios(layout)
    return profile.split_ratios or budgets.split_ratios(profile.budgets, profile.groups)
