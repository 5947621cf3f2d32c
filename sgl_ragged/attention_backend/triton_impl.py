"""Triton attention (the CUDA default): one kernel launch per layer for the whole batch.

Decode batches use the split-KV decode kernel driven by the static split map (kernels/aot.py);
extend and mixed batches the extend kernel. Both return the log-sum-exp of every query row, from
which the window queries' attention over the tail (the scorer's input) is recomputed on the tail
alone, without a second pass over the sealed rows. Staging and sealing then run for the whole
batch at once (tail_batch.store_tails), the selection and row scatter in the sealing kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata
from sgl_ragged.attention_backend.tail_batch import store_tails, tail_batch, tail_pages
from sgl_ragged.kernels.aot import SplitStrategy, device_parallelism, split_plan
from sgl_ragged.kernels.batch import KernelBatch, kernel_batch
from sgl_ragged.kernels.decode import decode_attention
from sgl_ragged.kernels.extend import extend_attention
from sgl_ragged.kernels.seal import seal_pages
from sgl_ragged.kernels.tables import all_layer_tables
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.scoring.select import sink_mask


class TritonAttention(AttentionImpl):
    """Ragged attention with the Triton kernels; the split map is fixed at construction."""

    def __init__(self, storage: RaggedStorage, split_ratios: Sequence[Sequence[float]],
                 strategy: SplitStrategy = SplitStrategy.AOT, num_ctas: int | None = None) -> None:
        super().__init__(storage)
        self.tables = all_layer_tables(storage)
        ctas = num_ctas or device_parallelism(storage.device)
        self.splits = split_plan(split_ratios, ctas, storage.device, strategy)

    def prepare(self, meta: RaggedForwardMetadata) -> None:
        meta.kernel = kernel_batch(meta.requests, self.storage.device)
        meta.tails = tail_batch(meta.requests, self.storage.layout.page_size, self.storage.device)

    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        out, lse = self.attend(layer, meta.kernel, q, k, v, scale, decode)
        assert meta.tails is not None, "prepare() did not run for this forward"
        k_pages, v_pages = tail_pages(self.storage, layer, meta.tails, k, v)
        store_tails(self.storage, layer, meta.tails, k_pages, v_pages, q, lse, scale, self.seal)
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
        """The sealing kernel for one layer's pages (a tail_batch.Sealer)."""
        sinks = sink_mask(page_start, self.storage.layout.page_size)
        seal_pages(self.tables[layer], src_k, src_v, src_index.int(), pages.int(), scores, sinks)
        self.storage.count_sealed(layer, pages.numel())
