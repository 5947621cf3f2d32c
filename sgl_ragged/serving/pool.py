"""SGLang-facing pool and allocator: logical pages stay SGLang's, storage is ragged.

`RaggedKVPool` keeps SGLang's MHA pool interface (capacity in logical tokens, isinstance checks
of in-tree code) but allocates no dense K/V buffers: only placeholders, plus a
`RaggedStorage`. `RaggedPagedAllocator` is SGLang's paged allocator that tells the storage when
logical pages are freed, so staging pages can never outlive the pages that own them.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import NoOpMHATokenToKVPool

from sgl_ragged.attention_backend.chunks import PrefillChunks
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.scoring import make_scorer
from sgl_ragged.serving.runtime import current_setup

logger = logging.getLogger(__name__)


class RaggedKVPool(NoOpMHATokenToKVPool):
    """MHA token-to-KV pool whose storage is a `RaggedStorage` (see storage.py). It also
    carries the prefill chunk boundaries from the scheduler hook to the backend's planning."""

    storage: RaggedStorage
    prefill_chunks: PrefillChunks

    def _create_buffers(self) -> None:
        super()._create_buffers()  # tiny placeholders for code that inspects k_buffer
        setup = current_setup()
        layout = setup.layout
        expected = (setup.start_layer, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                    layout.page_size)
        actual = (self.start_layer, self.layer_num, self.head_num, self.head_dim, self.page_size)
        if expected != actual:
            raise ValueError(
                "ragged layout (first layer, layers, kv heads, head_dim, page size) = "
                f"{expected} does not match SGLang's KV pool {actual}"
            )
        self.storage = RaggedStorage(
            layout,
            num_pages=(self.size + self.page_size) // self.page_size,
            num_staging_pages=setup.num_staging_pages,
            dtype=self.store_dtype,
            device=self.device,
            scorer=make_scorer(setup.config.scorer),
            dynamic_rho=setup.dynamic_rho,
            scale=setup.attention_scale,
        )
        self.prefill_chunks = PrefillChunks()

    def _finalize_allocation_log(self, num_tokens: int) -> None:
        self.mem_usage = self.storage.nbytes() / (1 << 30)
        layout = self.storage.layout
        logger.info(
            "Ragged KV cache: %d logical tokens (%d pages of %d), %d staging pages; "
            "retention %.3f, %d bytes per logical page vs %d full (capacity gain x%.2f); "
            "%.3f GB allocated",
            num_tokens, num_tokens // layout.page_size, layout.page_size,
            self.storage.num_staging_pages, layout.retention, layout.row_bytes_per_page,
            layout.full_bytes_per_page, 1.0 / layout.retention, self.mem_usage,
        )
        if self.storage.dynamic_rho is not None:
            logger.info(
                "Ragged dynamic reference mode: per-input Eq. 3 selection at rho %.2f, dropped "
                "tokens masked in full-size pages (saves no memory; for accuracy comparisons)",
                self.storage.dynamic_rho,
            )

    def get_kv_size_bytes(self) -> tuple[int, int]:
        half = self.storage.nbytes() // 2
        return half, half


class RaggedPagedAllocator(PagedTokenToKVPoolAllocator):
    """Paged allocator that releases a page's staging copy when SGLang frees the page."""

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        storage = self._ragged_storage()
        for ids in page_ids:
            storage.on_pages_freed(ids)
        super()._release_page_ids(*page_ids)

    def clear(self) -> None:
        super().clear()
        storage = getattr(self._kvcache, "storage", None)
        if storage is not None:
            storage.reset()

    def _ragged_storage(self) -> RaggedStorage:
        if not isinstance(self._kvcache, RaggedKVPool):
            raise TypeError(
                f"RaggedPagedAllocator needs a RaggedKVPool, got {type(self._kvcache).__name__}"
            )
        return self._kvcache.storage
