"""Scheduler-process hooks: capacity at the compressed cost, pool classes, sealing before insert.

Each function here is installed by plugin.register() as a HookRegistry hook; each acts only
when the ragged backend is active in this process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import ModelShape
from sgl_ragged.runtime import get_runtime
from sgl_ragged.scheduler.server_args import is_active
from sgl_ragged.tp import (
    agreed_cell_size,
    agreed_logical_pages,
    resolve_rank_profiles,
    tensor_parallel_rank,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)


# ---- capacity (Budget Reservation) ----------------------------------------------------------


def compute_cell_size(original: Any, configurator: Any, kvc: Any, num_layers: int) -> int:
    """AROUND DefaultPoolConfigurator._compute_cell_size: resolve the layout for this model and
    report the compressed bytes per logical token."""
    full = original(configurator, kvc, num_layers)
    if not is_active():
        return full
    from sglang.srt.runtime_context import get_schedule

    runtime = get_runtime()
    mc = kvc.model_config
    shape = ModelShape(
        architecture=(mc.hf_config.architectures or ["unknown"])[0],
        num_layers=num_layers,
        num_kv_heads=mc.get_num_kv_heads(1),
        head_dim=mc.head_dim,
    )
    tp_size, tp_rank = tensor_parallel_rank()
    # Each rank stores its slice of the whole-model profile (sgl_ragged/tp.py).
    profiles = resolve_rank_profiles(runtime.config.profile, shape, runtime.config.heads_per_group,
                                     tp_size)
    profile = profiles[tp_rank]
    runtime.profile = profile  # its split ratios give the decode kernel's AOT split map
    runtime.attention_scale = attention_scale(getattr(mc, "hf_text_config", mc.hf_config), mc.head_dim)
    schedule = get_schedule()
    dtype_bytes = torch._utils._element_size(kvc.kv_cache_dtype)
    layouts = [RaggedLayout.from_profile(p, schedule.page_size, mc.head_dim, dtype_bytes,
                                         precision=runtime.config.precision)
               for p in profiles]
    layout = layouts[tp_rank]
    runtime.rank_layouts = tuple(layouts)
    runtime.num_staging_pages = (schedule.max_running_requests + 1) * (runtime.config.window_pages + 1)
    cell = agreed_cell_size(layouts)  # ceil, widest rank: never over-admit
    if layout != runtime.layout:  # SGLang may size the pool twice with the same configuration
        logger.info("ragged capacity: %d bytes per logical token instead of %d (retention %.3f; %s)",
                    cell, full, layout.retention, layout.describe_tiers())
    runtime.layout = layout
    return cell


def attention_scale(hf_config: Any, head_dim: int) -> float:
    """The model's attention softmax scale from its config: 1/sqrt(query_pre_attn_scalar) where
    the config has one (Gemma 2/3), else 1/sqrt(head_dim) (Llama, Qwen, SmolLM2, ...)."""
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    return float(scalar if scalar else head_dim) ** -0.5


def calculate_pool_sizes(original: Any, configurator: Any, available_bytes: int, page_size: int) -> Any:
    """AROUND DefaultPoolConfigurator.calculate_pool_sizes: logical pages at the compressed
    cost, after the staging pool is taken out of the budget."""
    if not is_active():
        return original(configurator, available_bytes, page_size)
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    runtime = get_runtime()
    layout = runtime.require_layout()
    available = max(available_bytes - configurator._fixed_overhead_bytes, 0)
    # Every rank admits the same logical tokens: the smallest rank capacity (tp.py).
    pages = agreed_logical_pages(runtime.rank_layouts or (layout,), available,
                                 runtime.num_staging_pages)
    logger.info(
        "ragged capacity: %d logical pages from %.3f GB (%d staging pages take %.3f GB)",
        pages, available / 2**30, runtime.num_staging_pages,
        runtime.num_staging_pages * layout.staging_bytes_per_page() / 2**30,
    )
    return MemoryPoolConfig(max_total_num_tokens=pages * page_size)


def kv_pool_cls(original: Any, platform: Any, *, kind: str) -> Any:
    """AROUND SRTPlatform.get_kv_pool_cls."""
    if is_active() and kind == "mha":
        from sgl_ragged.mem_pool.pool import RaggedKVPool

        return RaggedKVPool
    return original(platform, kind=kind)


def paged_allocator_cls(original: Any, platform: Any) -> Any:
    """AROUND SRTPlatform.get_paged_allocator_cls."""
    if is_active():
        from sgl_ragged.mem_pool.pool import RaggedPagedAllocator

        return RaggedPagedAllocator
    return original(platform)


# ---- sealing before tree insertion ----------------------------------------------------------


def _storage_of(tree: Any) -> RaggedStorage | None:
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    return getattr(getattr(allocator, "_kvcache", None), "storage", None)


def checkpoint(original: Any, tree: Any, req: Req, *args: Any, up_to: int, **kwargs: Any) -> Any:
    """AROUND the radix cache's checkpoint(req, up_to): only sealed pages enter the tree.

    A finished request first seals its complete staged pages (DESIGN.md section 4); a running
    one publishes only its sealed prefix and keeps its window pages to itself.
    """
    storage = _storage_of(tree)
    if storage is None:
        return original(tree, req, *args, up_to=up_to, **kwargs)
    P = storage.layout.page_size
    row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    pages = (row[0 : up_to // P * P : P] // P).cpu().long()  # complete pages below up_to
    staged = storage.page_to_stage[pages] >= 0
    if req.finished():
        positions = torch.nonzero(staged).flatten() * P
        storage.sealer.seal_staged(pages[staged], positions)
    elif staged.any():
        up_to = int(torch.nonzero(staged)[0]) * P
    return original(tree, req, *args, up_to=up_to, **kwargs)


def after_prepare_for_extend(result: Any, batch: ScheduleBatch, *args: Any, **kwargs: Any) -> None:
    """AFTER ScheduleBatch.prepare_for_extend: tell the next forward which chunks are final
    (a non-final chunk seals all its complete pages; the final one keeps the window)."""
    chunks = getattr(batch.token_to_kv_pool_allocator._kvcache, "prefill_chunks", None)
    if chunks is None:
        return
    for req in batch.reqs:
        chunks.record(req.kv.req_pool_idx, req.extend_end >= len(req.full_untruncated_fill_ids))


def after_decode_graph_replay(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER DecodeCudaGraphRunner.execute: a replayed decode graph ran no Python, so the ragged
    backend's post-forward bookkeeping (mark sealed pages, metrics) runs here."""
    from sgl_ragged.attention_backend.backend import RaggedAttnBackend

    backend = runner._replay_attn_backend()
    if isinstance(backend, RaggedAttnBackend):
        backend.finish_graph_replay()
