"""The attention implementation seam: one layer, the whole batch (docs/architecture.md, "Attention implementations").

Every implementation -- the torch reference (torch_ref.TorchAttention, the oracle),
batched torch (batched_torch.BatchedTorchAttention, the CPU default) and the Triton kernels
(triton_impl.TritonAttention, the CUDA default) -- attends over sealed rows + staged tail + new
tokens, then stages and seals the tail of every request. Once per forward, `prepare` turns the
batch's plan into the implementation's own prepared batch, which every layer's `forward` reads.
registry.py picks one by device and `--ragged-attention`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from sgl_ragged.attention_backend.plan import BatchPlan
    from sgl_ragged.mem_pool.storage import RaggedStorage

Prepared = TypeVar("Prepared")
"""An implementation's per-forward inputs, built once by `prepare` (e.g. index tables)."""


class AttentionImpl(ABC, Generic[Prepared]):
    """One layer's ragged attention for a planned batch, with the tail's staging and sealing."""

    supports_cuda_graph = False  # decode reads only device tensors (graph.py's static buffers)

    def __init__(self, storage: RaggedStorage) -> None:
        self.storage = storage

    @abstractmethod
    def prepare(self, plan: BatchPlan) -> Prepared:
        """Once per forward, after planning: what every layer's call reads."""

    @abstractmethod
    def forward(self, layer: int, batch: Prepared, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        """q: [N, H_q, D]; k, v: [N, H, D] this forward's tokens (rows of the planned requests,
        in order); batch: what `prepare` returned. Returns [N, H_q, D] in q's dtype."""
