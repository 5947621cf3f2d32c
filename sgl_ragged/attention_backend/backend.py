"""The ragged attention backend's core: plan a forward, run its layers, finish it.

It takes plain arguments (the storage, an `AttentionImpl`, the settings, SGLang's
req_to_token table as a tensor) and knows nothing of SGLang: serving/backend.py adapts it to
SGLang's `AttentionBackend` (reads the ForwardBatch, builds it from the model runner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sgl_ragged.attention_backend.graph import DecodeGraphBuffers
from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.planner import plan_batch, take_staging
from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.storage import RaggedStorage, SealCounters
from sgl_ragged.rotation import HeadRotations

logger = logging.getLogger(__name__)


class BackendMetrics(Protocol):
    """Where the backend reports after each forward (serving/metrics.py: Prometheus)."""

    def update(self, counters: SealCounters, staging_in_use: int) -> None: ...

    def integrity(self, ok: bool) -> None: ...


@dataclass(frozen=True)
class RaggedForwardMetadata:
    """One forward's state: the plan, what the implementation prepared from it, and whether
    that is a captured decode graph's static buffers (graph.py)."""

    plan: BatchPlan
    prepared: Any  # the implementation's own prepared batch (AttentionImpl.prepare)
    graph: bool = False


class RaggedAttention:
    """Extend and decode attention with compression fused in (docs/architecture.md).

    Every forward: plan the batch, take its staging pages and let the implementation prepare
    (`begin_forward`); per layer (`forward`), attend over sealed rows + staged pages + the new
    tokens, then seal the pages leaving the recent window and stage the rest; after the last
    layer, mark the sealed pages and release their staging pages. The per-layer work is an
    `AttentionImpl` (registry.py).

    Decode graphs (graph.py, Triton only): `init_graph` once, `capture_graph` before a capture,
    `load_graph` before each replay, `finish_graph_replay` after it.
    """

    def __init__(self, storage: RaggedStorage, impl: AttentionImpl, config: RaggedConfig,
                 req_to_token: torch.Tensor, *,
                 free_pages: Callable[[], torch.Tensor] | None = None,
                 metrics: BackendMetrics | None = None,
                 rotation: HeadRotations | None = None) -> None:
        """req_to_token: [requests, max context] int, the logical token slot of each request's
        positions (SGLang's ReqToTokenPool table, read live). free_pages: the allocator's free
        logical pages, for the integrity check (`config.check_integrity`). rotation: the rows
        are stored rotated (--ragged-rotation hadamard; None: as computed); required exactly
        when `config.rotated`."""
        if config.check_integrity and free_pages is None:
            raise ValueError("config.check_integrity needs free_pages (the allocator's free "
                             "pages) to check the storage against")
        if config.rotated and rotation is None:
            raise ValueError(f"--ragged-rotation {config.rotation} needs the rows' rotations "
                             "(rotation=HeadRotations(...))")
        if rotation is not None and not config.rotated:
            raise ValueError("rotation= was given, but the config's --ragged-rotation is none")
        if rotation is not None and len(rotation.layers) != storage.layout.num_layers:
            raise ValueError(f"the rotations cover {len(rotation.layers)} layers, the storage "
                             f"{storage.layout.num_layers}")
        self.storage = storage
        self.impl = impl
        self.rotation = rotation
        self.config = config
        self.req_to_token = req_to_token
        self.free_pages = free_pages
        self.metrics = metrics
        self.num_layers = storage.layout.num_layers
        self.forward_metadata: RaggedForwardMetadata | None = None
        self.graph_buffers: DecodeGraphBuffers | None = None
        self._scale_warned = False

    # ---- planning ---------------------------------------------------------------------------

    def begin_forward(self, pool_idx: Sequence[int], prefixes: Sequence[int],
                      seq_lens: Sequence[int], final: Sequence[bool] | None = None) -> None:
        """Plan an eager forward: request r = req_to_token row pool_idx[r] goes from
        prefixes[r] to seq_lens[r] cached tokens; final[r]: its extend is its last prefill
        chunk (None: all are)."""
        self.storage.follow_forward()
        plan = plan_batch(self.req_to_token, self.storage, pool_idx, prefixes, seq_lens,
                          self.config.window_pages, self.config.obs_window, final)
        plan = take_staging(self.storage, plan)
        self.forward_metadata = RaggedForwardMetadata(plan, self.impl.prepare(plan))

    def begin_idle(self) -> None:
        """A forward without requests (idle ranks of a data-parallel batch)."""
        self.forward_metadata = None

    # ---- decode graphs ----------------------------------------------------------------------

    def init_graph(self, max_bs: int) -> None:
        """Static buffers for decode graphs of up to max_bs requests."""
        if not self.impl.supports_cuda_graph:
            raise RuntimeError(
                f"ragged attention {type(self.impl).__name__} cannot run under CUDA graphs "
                "(only the Triton kernels can); pass --cuda-graph-backend-decode disabled or "
                "--ragged-attention triton"
            )
        max_pages = -(-self.req_to_token.shape[1] // self.storage.layout.page_size)
        self.graph_buffers = DecodeGraphBuffers(self.storage, max_bs, self.config.window_pages,
                                                max_pages)

    def _graph(self) -> DecodeGraphBuffers:
        if self.graph_buffers is None:
            raise RuntimeError("decode graph buffers are missing: init_graph did not run")
        return self.graph_buffers

    def capture_graph(self, bs: int) -> None:
        """Before a decode graph's capture (or an idle replay): a batch of bs padding entries."""
        self.forward_metadata = RaggedForwardMetadata(BatchPlan([]),
                                                      self._graph().capture_metadata(bs),
                                                      graph=True)

    def load_graph(self, bs: int, pool_idx: Sequence[int], seq_lens: Sequence[int]) -> None:
        """Before a decode graph's replay: plan the real requests (one new token each) into
        the graph's buffers of bs entries; the rest are padding."""
        graph = self._graph()
        self.storage.follow_forward()
        plan = plan_batch(self.req_to_token, self.storage, pool_idx, [n - 1 for n in seq_lens],
                          seq_lens, self.config.window_pages, self.config.obs_window)
        plan = take_staging(self.storage, plan)
        self.forward_metadata = RaggedForwardMetadata(plan, graph.load(bs, plan), graph=True)

    def finish_graph_replay(self) -> None:
        """After a decode graph's replay: the bookkeeping the eager path does after its last
        layer (the replay runs no Python)."""
        meta = self.forward_metadata
        if meta is not None and meta.graph:
            self._finish_forward(meta)

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float, decode: bool) -> torch.Tensor:
        """One layer: q [T, H_q, D], k/v [T, H_kv, D] -> [T, H_q, D]. After the last layer of
        an eager forward, the post-forward bookkeeping runs."""
        meta = self.forward_metadata
        if meta is None:
            raise RuntimeError("no forward planned: begin_forward did not run for this forward")
        if scale != self.storage.scale and not self._scale_warned:
            self._scale_warned = True
            logger.warning("layer %d's attention scale %g differs from the model config's %g "
                           "(the scale scorers use when sealing outside a forward)",
                           layer_id, scale, self.storage.scale)
        rot = self.rotation
        if rot is not None:  # rows stored rotated: attention in the rotated basis, then back
            q, k, v = rot.rotate(q, layer_id), rot.rotate(k, layer_id), rot.rotate(v, layer_id)
        out = self.impl.forward(layer_id, meta.prepared, q, k, v, scale, decode)
        if rot is not None:
            out = rot.restore(out, layer_id)
        if layer_id == self.num_layers - 1 and not meta.graph:
            self._finish_forward(meta)  # graphs: finish_graph_replay, after the replay
        return out

    def _finish_forward(self, meta: RaggedForwardMetadata) -> None:
        """All layers wrote their rows: the sealed pages give back their staging pages."""
        self.storage.mark_sealed(meta.plan.pages_to_seal)
        if self.metrics is not None:
            self.metrics.update(self.storage.counters, self.storage.staging_in_use)
        if self.config.check_integrity:
            self._check_integrity()

    def _check_integrity(self) -> None:
        """The storage's integrity check against the allocator's free pages, counted in the
        metrics; a violation still raises."""
        assert self.free_pages is not None  # checked in __init__
        try:
            self.storage.check_integrity(self.free_pages())
        except AssertionError:
            if self.metrics is not None:
                self.metrics.integrity(ok=False)
            raise
        if self.metrics is not None:
            self.metrics.integrity(ok=True)
