"""`--attention-backend ragged`: SGLang attention backend over the ragged KV storage."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sgl_ragged.attention_backend.graph import DecodeGraphBuffers
from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.planner import plan_batch, plan_forward, take_staging
from sgl_ragged.attention_backend.registry import make_attention_impl
from sgl_ragged.mem_pool.pool import RaggedKVPool
from sgl_ragged.runtime import get_runtime
from sgl_ragged.scheduler.metrics import make_metrics
from sgl_ragged.tp import tensor_parallel_rank

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass(frozen=True)
class RaggedForwardMetadata:
    """One forward's state: the plan, what the implementation prepared from it, and whether
    that is a captured decode graph's static buffers (graph.py)."""

    plan: BatchPlan
    prepared: Any  # the implementation's own prepared batch (AttentionImpl.prepare)
    graph: bool = False


class RaggedAttnBackend(AttentionBackend):
    """Extend and decode attention with compression fused in (DESIGN.md section 7).

    Every forward: plan the batch, take its staging pages and let the implementation prepare
    (init_forward_metadata); per layer, attend over sealed rows +
    staged pages + the new tokens, then seal the pages leaving the recent window and stage the
    rest; after the last layer, mark the sealed pages and release their staging pages. The
    per-layer work is an `AttentionImpl` (registry.py): Triton kernels on CUDA, batched torch on
    the CPU, the per-request torch reference as the oracle and for the dynamic mode.

    Decode runs under SGLang's CUDA graphs with the Triton kernels (graph.py): the graph runner
    calls init_cuda_graph_state once, init_forward_metadata_out_graph before each capture and
    replay, and finish_graph_replay (a plugin hook) after each replay.
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
        self.prefill_chunks = pool.prefill_chunks  # chunk boundaries from the scheduler hook
        runtime = get_runtime()
        self.config = runtime.config
        # Query heads of this tensor-parallel rank (the model's with --tp-size 1).
        num_q_heads = model_runner.model_config.num_attention_heads // tensor_parallel_rank()[0]
        self.impl = make_attention_impl(self.storage, runtime.profile, self.config.attention,
                                        num_q_heads)
        logger.info("ragged attention: %s (--ragged-attention %s)", type(self.impl).__name__,
                    self.config.attention)
        self.num_layers = self.storage.layout.num_layers
        self.forward_metadata: RaggedForwardMetadata | None = None
        self.metrics = make_metrics()
        self.graph_buffers: DecodeGraphBuffers | None = None
        self._scale_warned = False

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_target_verify():
            raise NotImplementedError("the ragged backend does not support speculative decoding")
        final = self.prefill_chunks.take(forward_batch.req_pool_indices.tolist())
        plan = plan_forward(forward_batch, self.req_to_token_pool.req_to_token, self.storage,
                            self.config.window_pages, self.config.obs_window, final)
        plan = take_staging(self.storage, plan)
        self.forward_metadata = RaggedForwardMetadata(plan, self.impl.prepare(plan))

    # ---- CUDA graphs (decode) -------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers for decode graphs of up to max_bs requests."""
        if not self.impl.supports_cuda_graph:
            raise RuntimeError(
                f"ragged attention {type(self.impl).__name__} cannot run under CUDA graphs "
                "(only the Triton kernels can); pass --cuda-graph-backend-decode disabled or "
                "--ragged-attention triton"
            )
        P = self.storage.layout.page_size
        max_pages = -(-self.req_to_token_pool.req_to_token.shape[1] // P)
        self.graph_buffers = DecodeGraphBuffers(self.storage, max_bs, self.config.window_pages,
                                                max_pages)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch,
                                        in_capture: bool = False) -> None:
        """Before a decode graph's capture (a batch of padding) or replay (plan the real
        requests, the first batch_size - num_padding, into the graph's buffers)."""
        graph = self.graph_buffers
        assert graph is not None, "init_cuda_graph_state did not run"
        bs = forward_batch.batch_size
        mode = getattr(forward_batch, "actual_forward_mode", forward_batch.forward_mode)
        if in_capture or mode.is_idle():
            self.forward_metadata = RaggedForwardMetadata(BatchPlan([]), graph.capture_metadata(bs),
                                                          graph=True)
            return
        if not mode.is_decode():
            raise NotImplementedError(f"the ragged backend captures decode graphs only, not {mode}")
        raw = bs - getattr(forward_batch, "num_padding", 0)
        seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                    else forward_batch.seq_lens.cpu())[:raw].tolist()
        plan = plan_batch(self.req_to_token_pool.req_to_token, self.storage,
                          forward_batch.req_pool_indices[:raw].tolist(),
                          [n - 1 for n in seq_lens], seq_lens,
                          self.config.window_pages, self.config.obs_window)
        plan = take_staging(self.storage, plan)
        self.forward_metadata = RaggedForwardMetadata(plan, graph.load(bs, plan), graph=True)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Nothing: the graph's buffers are filled before the replay, on the host."""

    def finish_graph_replay(self) -> None:
        """After a decode graph's replay: the bookkeeping the eager path does after its last
        layer (the replay runs no Python)."""
        meta = self.forward_metadata
        if meta is not None and meta.graph:
            self._finish_forward(meta)

    # ---- forward ----------------------------------------------------------------------------

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
        if layer.scaling != self.storage.scale and not self._scale_warned:
            self._scale_warned = True
            logger.warning("layer %d's attention scale %g differs from the model config's %g "
                           "(the scale scorers use when sealing outside a forward)",
                           layer.layer_id, layer.scaling, self.storage.scale)
        out = self.impl.forward(layer.layer_id, meta.prepared, q3, k3, v3, layer.scaling, decode)
        if layer.layer_id == self.num_layers - 1 and not meta.graph:
            self._finish_forward(meta)  # graphs: finish_graph_replay, after the replay
        return out.reshape(q.shape[0], h_q * d)

    def _finish_forward(self, meta: RaggedForwardMetadata) -> None:
        """All layers wrote their rows: the sealed pages give back their staging pages."""
        self.storage.mark_sealed(meta.plan.pages_to_seal)
        if self.metrics is not None:
            self.metrics.update(self.storage.counters, self.storage.staging_in_use)
        if self.config.check_integrity:
            self._check_integrity()

    def _check_integrity(self) -> None:
        """The pool's integrity check, counted on /metrics; a violation still raises."""
        try:
            self.token_to_kv_pool.check_integrity(self.allocator)
        except AssertionError:
            if self.metrics is not None:
                self.metrics.integrity(ok=False)
            raise
        if self.metrics is not None:
            self.metrics.integrity(ok=True)

    def support_triton(self) -> bool:
        return False


def create_ragged_backend(model_runner: ModelRunner) -> RaggedAttnBackend:
    """Factory registered under the name `ragged` in SGLang's attention registry."""
    return RaggedAttnBackend(model_runner)
