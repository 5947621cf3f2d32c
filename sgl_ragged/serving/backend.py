"""`--attention-backend ragged`: the core (attention_backend/backend.py) as SGLang's backend.

This adapter reads SGLang's ForwardBatch into plain lists for the core's planning, reshapes a
RadixAttention layer's q/k/v, and builds the core from a ModelRunner (`from_model_runner`:
the pool's storage, the implementation registry.py picks, the process's `ServingSetup`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sgl_ragged.attention_backend.backend import RaggedAttention, RaggedForwardMetadata
from sgl_ragged.attention_backend.chunks import PrefillChunks
from sgl_ragged.attention_backend.registry import make_attention_impl
from sgl_ragged.serving.metrics import make_metrics
from sgl_ragged.serving.pool import RaggedKVPool
from sgl_ragged.serving.runtime import current_setup, tensor_parallel_rank

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class RaggedAttnBackend(AttentionBackend):
    """SGLang's attention backend interface over a `RaggedAttention` core.

    Eager forwards: init_forward_metadata plans the batch (with the prefill chunk boundaries
    the scheduler hook recorded in `chunks`), forward_extend/forward_decode run one layer.
    Decode CUDA graphs (Triton only): SGLang's graph runner calls init_cuda_graph_state once,
    init_forward_metadata_out_graph before each capture and replay, and the plugin's hook
    after each replay calls finish_graph_replay.
    """

    def __init__(self, attention: RaggedAttention, chunks: PrefillChunks | None = None,
                 start_layer: int = 0, token_to_kv_pool: RaggedKVPool | None = None,
                 req_to_token_pool: Any = None) -> None:
        super().__init__()
        self.attention = attention
        self.chunks = chunks if chunks is not None else PrefillChunks()
        self.start_layer = start_layer  # a pipeline stage's first model layer: its storage's 0
        # What SGLang's forward context hands models (`get_token_to_kv_pool()`,
        # `get_req_to_token_pool()`: Qwen3-MoE's attention reads the pool every forward).
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token_pool = req_to_token_pool

    @classmethod
    def from_model_runner(cls, model_runner: ModelRunner) -> RaggedAttnBackend:
        """The backend over the model runner's ragged pool, with the published setup."""
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, RaggedKVPool):
            raise TypeError(
                f"the ragged backend needs its own KV pool, but SGLang built {type(pool).__name__}; "
                "is another plugin overriding the KV pool class?"
            )
        check_attention_layers(model_runner.model)
        setup = current_setup()
        # Query heads of this tensor-parallel rank (the model's with --tp-size 1).
        num_q_heads = model_runner.model_config.num_attention_heads // tensor_parallel_rank()[0]
        impl = make_attention_impl(pool.storage, setup.profile, setup.config.attention, num_q_heads)
        logger.info("ragged attention: %s (--ragged-attention %s)", type(impl).__name__,
                    setup.config.attention)
        allocator = model_runner.token_to_kv_pool_allocator
        attention = RaggedAttention(pool.storage, impl, setup.config,
                                    model_runner.req_to_token_pool.req_to_token,
                                    free_pages=allocator.get_all_free_pages,
                                    metrics=make_metrics(),
                                    rotation=setup.rotations(pool.storage.device))
        return cls(attention, pool.prefill_chunks, setup.start_layer, pool,
                   model_runner.req_to_token_pool)

    @property
    def forward_metadata(self) -> RaggedForwardMetadata | None:  # read by SGLang's generic code
        return self.attention.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value: RaggedForwardMetadata | None) -> None:
        self.attention.forward_metadata = value

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.attention.begin_idle()
            return
        if mode.is_target_verify():
            raise NotImplementedError("the ragged backend does not support speculative decoding")
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        pool_idx = _pool_indices(forward_batch, len(seq_lens))
        if mode.is_decode():
            prefixes = [s - 1 for s in seq_lens]
        else:
            prefixes = list(forward_batch.extend_prefix_lens_cpu)
        self.attention.begin_forward(pool_idx, prefixes, seq_lens, self.chunks.take(pool_idx))

    # ---- CUDA graphs (decode) -------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.attention.init_graph(max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch,
                                        in_capture: bool = False) -> None:
        """Before a decode graph's capture (a batch of padding) or replay (plan the real
        requests, the first batch_size - num_padding, into the graph's buffers)."""
        bs = forward_batch.batch_size
        mode = getattr(forward_batch, "actual_forward_mode", forward_batch.forward_mode)
        if in_capture or mode.is_idle():
            self.attention.capture_graph(bs)
            return
        if not mode.is_decode():
            raise NotImplementedError(f"the ragged backend captures decode graphs only, not {mode}")
        raw = bs - getattr(forward_batch, "num_padding", 0)
        seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                    else forward_batch.seq_lens.cpu())[:raw].tolist()
        self.attention.load_graph(bs, _pool_indices(forward_batch, raw), seq_lens)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Nothing: the graph's buffers are filled before the replay, on the host."""

    def finish_graph_replay(self) -> None:
        self.attention.finish_graph_replay()

    # ---- forward ----------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs) -> torch.Tensor:
        _refuse_sinks(kwargs)
        return self._forward(q, k, v, layer, decode=False)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs) -> torch.Tensor:
        _refuse_sinks(kwargs)
        return self._forward(q, k, v, layer, decode=True)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layer: RadixAttention, decode: bool) -> torch.Tensor:
        h_q, h_kv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        out = self.attention.forward(layer.layer_id - self.start_layer, q.reshape(-1, h_q, d),
                                     k.reshape(-1, h_kv, d), v.reshape(-1, h_kv, layer.v_head_dim),
                                     layer.scaling, decode)
        return out.reshape(q.shape[0], h_q * d)

    def support_triton(self) -> bool:
        return False


def check_attention_layers(model: torch.nn.Module) -> None:
    """Refuse a model whose attention layers ask for what the ragged backend does not compute
    (it runs causal softmax attention over each request's whole history, with the layer's
    scale): a sliding window, logit capping, learned sinks, cross or non-causal attention,
    value heads of another size than the keys', or a layer SGLang marks for another attention
    variant. The architecture check at startup admits whole model families; this one reads the
    layers a given checkpoint built (SGLang's OLMo 2 builds sliding-window layers from a
    config's `layer_types`, its Granite sinks and windows for the granite_swa model types)."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

    for name, layer in model.named_modules():
        if isinstance(getattr(layer, "sinks", None), torch.Tensor):
            raise ValueError(
                f"--attention-backend ragged cannot serve this checkpoint: its attention {name} "
                "has learned attention sinks (a per-head logit beside every softmax), which the "
                "ragged backend does not compute; serve this checkpoint with a stock attention "
                "backend"
            )
        if not isinstance(layer, RadixAttention):
            continue
        asks = {
            "a sliding window": (layer.sliding_window_size or -1) > 0,
            "logit capping": (layer.logit_cap or 0.0) > 0,
            "cross-attention": bool(layer.is_cross_attention),
            f"{getattr(layer.attn_type, 'value', layer.attn_type)} attention":
                layer.attn_type != AttentionType.DECODER,
            f"value heads of {layer.v_head_dim} channels beside keys of {layer.head_dim}":
                layer.v_head_dim != layer.head_dim,
            "a length-scaled temperature": getattr(layer, "xai_temperature_len", -1) > 0,
            f"position encoding {layer.pos_encoding_mode} inside attention":
                getattr(layer, "pos_encoding_mode", "NONE") != "NONE",
        }
        wanted = [what for what, asked in asks.items() if asked]
        if wanted:
            raise ValueError(
                f"--attention-backend ragged cannot serve this checkpoint: its attention layer "
                f"{name} (layer {layer.layer_id}) asks for {' and '.join(wanted)}, which the ragged "
                "backend does not compute (full causal attention only); serve this checkpoint "
                "with a stock attention backend (e.g. --attention-backend torch_native on a CPU, "
                "triton on a GPU)"
            )


def _refuse_sinks(kwargs: dict[str, Any]) -> None:
    """A layer that hands attention learned sinks was refused at startup
    (`check_attention_layers`); never attend as if it had none."""
    if kwargs.get("sinks") is not None:
        raise ValueError("the ragged backend does not compute learned attention sinks")


def create_ragged_backend(model_runner: ModelRunner) -> RaggedAttnBackend:
    """Factory registered under the name `ragged` in SGLang's attention registry."""
    return RaggedAttnBackend.from_model_runner(model_runner)


_noted: tuple[list[int], list[int]] | None = None  # the latest forward batch's (rows, lens)


def note_forward_batch(rows_and_lens: tuple[list[int], list[int]] | None) -> None:
    """The forward batch SGLang built last (scheduler_hooks.after_forward_batch_init): its
    requests' req_to_token rows and its sequence lengths, host lists (None: none known)."""
    global _noted
    _noted = rows_and_lens


def _pool_indices(forward_batch: ForwardBatch, count: int) -> list[int]:
    """The first `count` requests' req_to_token rows as a host list: the noted batch's, if its
    sequence lengths are this batch's (taken once); else read from the device tensor, which on
    CUDA waits for the forward in flight. On a CPU, where that read is free, the two are
    compared (every CPU server checks the hook's assumption)."""
    global _noted
    noted, _noted = _noted, None
    rows = forward_batch.req_pool_indices[:count]
    lens = forward_batch.seq_lens_cpu
    if (noted is None or lens is None or len(noted[0]) < count
            or noted[1][:count] != lens[:count].tolist()):
        return rows.tolist()
    host = noted[0][:count]
    if not rows.is_cuda and host != rows.tolist():
        raise RuntimeError(
            f"the batch's requests give req_to_token rows {host} but its req_pool_indices are "
            f"{rows.tolist()}: the ForwardBatch.init_new hook's assumption (ScheduleBatch.reqs "
            "in req_pool_indices order) does not hold here; please report it"
        )
    return host
