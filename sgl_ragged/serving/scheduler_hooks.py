"""Scheduler-process hooks: capacity at the compressed cost, pool classes, sealing before insert.

Each function here is installed by serving/plugin.register() as a HookRegistry hook; each acts only
when the ragged backend is active in this process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import ModelShape
from sgl_ragged.serving.runtime import (
    attention_scale,
    build_setup,
    current_setup,
    pipeline_stage,
    publish_setup,
    tensor_parallel_rank,
)
from sgl_ragged.serving.server_args import is_active

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)


# ---- capacity (Budget Reservation) ----------------------------------------------------------


def compute_cell_size(original: Any, configurator: Any, kvc: Any, num_layers: int) -> int:
    """AROUND DefaultPoolConfigurator._compute_cell_size (SGLang calls it once, from the
    configurator's constructor: the first point where the model config, page size and layer
    count meet): build and publish this process's `ServingSetup` (runtime.py), report the
    compressed bytes per logical token."""
    full = original(configurator, kvc, num_layers)
    if not is_active():
        return full
    from sglang.srt.runtime_context import get_schedule

    mc = kvc.model_config
    # The profile fits the whole model; a pipeline stage serves its layers' slice of it.
    layers = pipeline_stage(kvc.layer_info, num_layers, mc.num_hidden_layers)
    shape = ModelShape(
        architecture=(mc.hf_config.architectures or ["unknown"])[0],
        num_layers=num_layers if layers is None else mc.num_hidden_layers,
        num_kv_heads=mc.get_num_kv_heads(1),
        head_dim=mc.head_dim,
    )
    schedule = get_schedule()
    tp_size, tp_rank = tensor_parallel_rank()
    setup = build_setup(
        RaggedConfig.from_env(), shape,
        page_size=schedule.page_size,
        dtype_bytes=torch._utils._element_size(kvc.kv_cache_dtype),
        max_running_requests=schedule.max_running_requests,
        tp_size=tp_size, tp_rank=tp_rank,
        attention_scale=attention_scale(getattr(mc, "hf_text_config", mc.hf_config), mc.head_dim),
        layers=layers,
    )
    cell = setup.cell_size()  # ceil, widest rank: never over-admit
    if publish_setup(setup):
        logger.info("ragged capacity: %d bytes per logical token instead of %d (retention %.3f; %s)",
                    cell, full, setup.layout.retention, setup.layout.describe_tiers())
    return cell


def calculate_pool_sizes(original: Any, configurator: Any, available_bytes: int, page_size: int) -> Any:
    """AROUND DefaultPoolConfigurator.calculate_pool_sizes: logical pages at the compressed
    cost, after the staging pool is taken out of the budget."""
    if not is_active():
        return original(configurator, available_bytes, page_size)
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    setup = current_setup()
    available = max(available_bytes - configurator._fixed_overhead_bytes, 0)
    pages = setup.logical_pages(available)  # the smallest rank capacity (tp.py)
    logger.info(
        "ragged capacity: %d logical pages from %.3f GB (%d staging pages take %.3f GB)",
        pages, available / 2**30, setup.num_staging_pages,
        setup.num_staging_pages * setup.layout.staging_bytes_per_page() / 2**30,
    )
    return MemoryPoolConfig(max_total_num_tokens=pages * page_size)


def kv_pool_cls(original: Any, platform: Any, *, kind: str) -> Any:
    """AROUND SRTPlatform.get_kv_pool_cls."""
    if is_active() and kind == "mha":
        from sgl_ragged.serving.pool import RaggedKVPool

        return RaggedKVPool
    return original(platform, kind=kind)


def paged_allocator_cls(original: Any, platform: Any) -> Any:
    """AROUND SRTPlatform.get_paged_allocator_cls."""
    if is_active():
        from sgl_ragged.serving.pool import RaggedPagedAllocator

        return RaggedPagedAllocator
    return original(platform)


# ---- sealing before tree insertion ----------------------------------------------------------


def _storage_of(tree: Any) -> RaggedStorage | None:
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    return getattr(getattr(allocator, "_kvcache", None), "storage", None)


def checkpoint(original: Any, tree: Any, req: Req, *args: Any, up_to: int, **kwargs: Any) -> Any:
    """AROUND the radix cache's checkpoint(req, up_to): only sealed pages enter the tree.

    A finished request first seals its complete staged pages (docs/architecture.md, "One forward pass"); a running
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
        storage.seal_staged(pages[staged], positions)
    elif staged.any():
        up_to = int(torch.nonzero(staged)[0]) * P
    return original(tree, req, *args, up_to=up_to, **kwargs)


def after_prepare_for_extend(result: Any, batch: ScheduleBatch, *args: Any, **kwargs: Any) -> None:
    """AFTER ScheduleBatch.prepare_for_extend: tell the next forward which chunks are final
    (a non-final chunk seals all its complete pages; the final one keeps the window), and the
    storage which stream the scheduler writes req_to_token on (RaggedStorage.follow_scheduler:
    on CUDA, planning reads its rows behind that stream only)."""
    pool = batch.token_to_kv_pool_allocator._kvcache
    chunks = getattr(pool, "prefill_chunks", None)
    if chunks is None:
        return
    pool.storage.follow_scheduler()
    for req in batch.reqs:
        chunks.record(req.kv.req_pool_idx, req.extend_end >= len(req.full_untruncated_fill_ids))


def after_forward_batch_init(result: Any, cls: Any, batch: ScheduleBatch, *args: Any,
                             **kwargs: Any) -> None:
    """AFTER ForwardBatch.init_new: the batch's req_to_token rows as a host list, from its
    requests (ScheduleBatch keeps `reqs` and `req_pool_indices` in the same order), with its
    host sequence lengths to recognize it by. SGLang's runners copy a forward batch into their
    static buffers before the attention backend sees it, so this goes beside it
    (serving/backend.py `note_forward_batch`): on CUDA, `req_pool_indices.tolist()` there
    would wait for the forward in flight."""
    if not is_active():
        return
    from sgl_ragged.serving.backend import note_forward_batch

    reqs = getattr(batch, "reqs", None) or []
    lens = getattr(result, "seq_lens_cpu", None)
    if not reqs or lens is None:
        note_forward_batch(None)
        return
    note_forward_batch(([req.kv.req_pool_idx for req in reqs], lens.tolist()))


def after_decode_graph_replay(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER DecodeCudaGraphRunner.execute: a replayed decode graph ran no Python, so the ragged
    backend's post-forward bookkeeping (mark sealed pages, metrics) runs here."""
    from sgl_ragged.serving.backend import RaggedAttnBackend

    backend = runner._replay_attn_backend()
    if isinstance(backend, RaggedAttnBackend):
        backend.finish_graph_replay()


# ---- model inputs ---------------------------------------------------------------------------


def extend_forward_kwargs(original: Any, runner: Any, forward_batch: Any, *args: Any,
                          **kwargs: Any) -> dict:
    """AROUND ModelRunner._extend_forward_kwargs: SGLang 0.5.23 hands a request's `input_embeds`
    to the model in bfloat16 whatever the model's dtype, so on a float32 or float16 model the
    first layer's product fails on the mismatch and takes the scheduler down (stock backends
    too). With ragged they go in at the model's dtype, as an embedding lookup of the same
    tokens would, with the token overrides (`replace_embeds`) scattered as SGLang does."""
    out = original(runner, forward_batch, *args, **kwargs)
    embeds = getattr(forward_batch, "input_embeds", None)
    if not is_active() or embeds is None or runner.dtype == torch.bfloat16:
        return out
    replace, positions = forward_batch.replace_embeds, forward_batch.replace_positions
    overrides = replace is not None and positions is not None
    embeds = embeds.to(runner.dtype, copy=overrides)  # the batch's own tensor stays as it is
    if overrides:
        embeds[positions] = replace.to(embeds.dtype)
    out["input_embeds"] = embeds
    return out


def fused_set_kv_buffer(original: Any, forward_batch: Any) -> bool:
    """AROUND models.utils.enable_fused_set_kv_buffer: on CUDA with a bfloat16 pool, SGLang's
    Qwen3-MoE (and a few others) write K and V into the pool's dense buffers inside their
    rotary embedding and then tell attention not to save them. The ragged pool's dense buffers
    are placeholders (its backend stores what it attends, in its own layout), so with ragged
    the model always hands K and V to attention."""
    if is_active():
        return False
    return original(forward_batch)
