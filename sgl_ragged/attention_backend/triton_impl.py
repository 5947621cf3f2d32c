"""Triton attention (the CUDA default): one kernel launch per layer for the whole batch.

Decode batches use the split-KV decode kernel driven by the static split map (kernels/aot.py);
extend and mixed batches the extend kernel. Both return the log-sum-exp of every query row, from
which the window queries' attention over the tail (the scorer's input) is recomputed on the tail
alone, without a second pass over the sealed rows. Staging and sealing then run for the whole
batch at once (tail_batch.store_tails), the selection and row scatter in the sealing kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata
from sgl_ragged.attention_backend.tail_batch import store_tails, tail_batch, tail_pages
from sgl_ragged.kernels.aot import (
    PROGRAMS_PER_SM,
    SplitStrategy,
    device_parallelism,
    split_plan,
)
from sgl_ragged.kernels.batch import KernelBatch, kernel_batch
from sgl_ragged.kernels.decode import decode_attention, split_kernel_resources
from sgl_ragged.kernels.extend import extend_attention
from sgl_ragged.kernels.occupancy import SMLimits, programs_per_sm
from sgl_ragged.kernels.seal import seal_pages
from sgl_ragged.kernels.tables import LayerTables, all_layer_tables
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.scoring.select import sink_mask

logger = logging.getLogger(__name__)


class TritonAttention(AttentionImpl):
    """Ragged attention with the Triton kernels; the split map is fixed at construction."""

    supports_cuda_graph = True  # decode reads only device tensors (graph.py's static buffers)

    def __init__(self, storage: RaggedStorage, split_ratios: Sequence[Sequence[float]],
                 strategy: SplitStrategy = SplitStrategy.AOT, num_ctas: int | None = None,
                 num_q_heads: int | None = None) -> None:
        """num_ctas: N_CTA of the split map; by default SMs x the split kernel's resident
        programs per SM, measured from its build for num_q_heads query heads when given."""
        super().__init__(storage)
        self.tables = all_layer_tables(storage)
        if num_ctas is None:
            num_ctas = decode_parallelism(storage, self.tables[0], split_ratios, num_q_heads)
        self.splits = split_plan(split_ratios, num_ctas, storage.device, strategy)

    def prepare(self, meta: RaggedForwardMetadata) -> None:
        meta.kernel = kernel_batch(meta.requests, self.storage.device)
        meta.tails = tail_batch(meta.requests, self.storage.layout.page_size, self.storage.device)

    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        out, lse = self.attend(layer, meta.kernel, q, k, v, scale, decode)
        assert meta.tails is not None, "prepare() did not run for this forward"
        k_pages, v_pages = tail_pages(self.storage, layer, meta.tails, k, v)
        store_tails(self.storage, layer, meta.tails, k_pages, v_pages, q, lse, scale, self.seal)
        if not meta.graph:  # a captured graph's tails are padded; graph.py counts its real pages
            self.storage.count_sealed(layer, meta.tails.num_seal)
        return out

    def attend(self, layer: int, batch: KernelBatch | None, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention only: out [N, H_q, D] and lse [N, H_q] float32, one launch (two for decode)."""
        assert batch is not None, "prepare() did not run for this forward"
        st = self.storage
        if decode:
            return decode_attention(q, k, v, st.stage_k[layer], st.stage_v[layer],
                                    self.tables[layer], self.splits.layer(layer), batch, scale)
        return extend_attention(q, k, v, st.stage_k[layer], st.stage_v[layer], self.tables[layer],
                                batch, scale)

    def seal(self, layer: int, src_k: torch.Tensor, src_v: torch.Tensor, src_index: torch.Tensor,
             pages: torch.Tensor, page_start: torch.Tensor, scores: torch.Tensor) -> None:
        """The sealing kernel for one layer's pages (a tail_batch.Sealer; pages of -1 are
        padding and write nothing). Counted by the caller."""
        sinks = sink_mask(page_start, self.storage.layout.page_size)
        seal_pages(self.tables[layer], src_k, src_v, src_index.int(), pages.int(), scores, sinks)


def decode_parallelism(storage: RaggedStorage, tables: LayerTables,
                       split_ratios: Sequence[Sequence[float]], num_q_heads: int | None) -> int:
    """N_CTA on this device: SMs x resident programs per SM of the split kernel as compiled
    for these shapes (aot.PROGRAMS_PER_SM where it cannot be measured: not CUDA, no head
    count, or a Triton build that does not expose its resource use)."""
    device = storage.device
    if device.type != "cuda" or num_q_heads is None:
        return device_parallelism(device)
    probe = split_plan(split_ratios, 1, device)  # one split per group: sizes the probe's buffers
    try:
        used = split_kernel_resources(tables, probe.layer(0), num_q_heads,
                                      storage.layout.head_dim, storage.dtype)
    except (AttributeError, RuntimeError, TypeError) as exc:
        logger.warning("could not read the split kernel's resource use (%s); assuming %d "
                       "programs per SM", exc, PROGRAMS_PER_SM)
        return device_parallelism(device)
    per_sm = programs_per_sm(used, SMLimits.of(device))
    num_ctas = device_parallelism(device, per_sm)
    logger.info("decode split kernel: %d registers/thread, %d B shared, %d warps -> %d programs "
                "per SM, N_CTA %d", used.registers_per_thread, used.shared_bytes, used.num_warps,
                per_sm, num_ctas)
    return num_ctas
