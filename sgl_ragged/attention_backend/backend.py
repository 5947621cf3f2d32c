"""`--attention-backend ragged`: SGLang attention backend over the ragged KV storage."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sgl_ragged.attention_backend.impl import make_attention_impl
from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata, build_metadata
from sgl_ragged.mem_pool.pool import RaggedKVPool
from sgl_ragged.runtime import get_runtime
from sgl_ragged.scheduler.metrics import make_metrics

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


class RaggedAttnBackend(AttentionBackend):
    """Extend and decode attention with compression fused in (DESIGN.md section 7).

    Every forward: plan the batch (init_forward_metadata); per layer, attend over sealed rows +
    staged pages + the new tokens, then seal the pages leaving the recent window and stage the
    rest; after the last layer, mark the sealed pages and release their staging pages. The
    per-layer work is an `AttentionImpl`: Triton kernels on CUDA, the torch reference elsewhere.
    """

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, RaggedKVPool):
            raise TypeError(
                f"the ragged backend needs its own KV pool, but SGLang built {type(pool).__name__}; "
                "is another plugin overriding the KV pool class?"
            )
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.storage = pool.storage
        runtime = get_runtime()
        self.config = runtime.config
        num_q_heads = model_runner.model_config.num_attention_heads  # --tp-size 1 only
        self.impl = make_attention_impl(self.storage, runtime.profile, self.config.attention,
                                        num_q_heads)
        logger.info("ragged attention: %s (--ragged-attention %s)", type(self.impl).__name__,
                    self.config.attention)
        self.num_layers = self.storage.layout.num_layers
        self.forward_metadata: RaggedForwardMetadata | None = None
        self.metrics = make_metrics()

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_target_verify():
            raise NotImplementedError("the ragged backend does not support speculative decoding")
        self.forward_metadata = build_metadata(
            forward_batch,
            self.req_to_token_pool.req_to_token,
            self.storage,
            window_pages=self.config.window_pages,
            obs_window=self.config.obs_window,
        )
        self.impl.prepare(self.forward_metadata)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs) -> torch.Tensor:
        return self._forward(q, k, v, layer, decode=False)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs) -> torch.Tensor:
        return self._forward(q, k, v, layer, decode=True)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layer: RadixAttention, decode: bool) -> torch.Tensor:
        meta = self.forward_metadata
        assert meta is not None, "init_forward_metadata did not run for this forward"
        h_q, h_kv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q3 = q.reshape(-1, h_q, d)
        k3 = k.reshape(-1, h_kv, d)
        v3 = v.reshape(-1, h_kv, layer.v_head_dim)
        self.storage.scale = layer.scaling  # scorers that model attention logits need it
        out = self.impl.forward(layer.layer_id, meta, q3, k3, v3, layer.scaling, decode)
        if layer.layer_id == self.num_layers - 1:
            self._finish_forward(meta)
        return out.reshape(q.shape[0], h_q * d)

    def _finish_forward(self, meta: RaggedForwardMetadata) -> None:
        """All layers wrote their rows: the sealed pages give back their staging pages."""
        self.storage.mark_sealed(meta.pages_to_seal)
        if self.metrics is not None:
            self.metrics.update(self.storage.counters, self.storage.staging_in_use)
        if self.config.check_integrity:
            self.token_to_kv_pool.check_integrity(self.allocator)

    def support_triton(self) -> bool:
        return False


def create_ragged_backend(model_runner: ModelRunner) -> RaggedAttnBackend:
    """Factory registered under the name `ragged` in SGLang's attention registry."""
    return RaggedAttnBackend(model_runner)
