"""The Triton path's prepared batch: kernel page tables plus the batch's tail pages.

Built once per forward by `TritonAttention.prepare`, or filled into static buffers before a
decode graph's replay (graph.py's `DecodeGraphBuffers`). No Triton import here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.tail_batch import TailBatch, tail_batch
from sgl_ragged.kernels.batch import KernelBatch, kernel_batch


@dataclass(frozen=True)
class TritonBatch:
    """Per-forward inputs of the Triton kernels and of the batched staging and sealing."""

    kernel: KernelBatch  # page tables, staged-token counts, q offsets (kernels/batch.py)
    tails: TailBatch  # the batch's tail pages (tail_batch.py)


def triton_batch(plan: BatchPlan, page_size: int, device: torch.device) -> TritonBatch:
    return TritonBatch(kernel=kernel_batch(plan.requests, device),
                       tails=tail_batch(plan.requests, page_size, device))
