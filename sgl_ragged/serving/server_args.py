"""Launch-time checks and defaults for `--attention-backend ragged` (main process).

Runs inside SGLang's argument resolution, before any child process is spawned, so every error
here reaches the user as one clear message on the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from sgl_ragged.attention_backend.registry import triton_refuses
from sgl_ragged.compat import cpu_gemm, cpu_lora, cpu_ops
from sgl_ragged.config import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_PAGE_SIZE,
    SERVED_ARCHITECTURES,
    RaggedConfig,
    add_cli_args,
    move_cli_args_to_env,
)
from sgl_ragged.native import pool as native_pool
from sgl_ragged.precision import tier_precision
from sgl_ragged.profile import ModelFreeKind, ModelShape, model_free_kind, model_shape
from sgl_ragged.serving.history_holds import explicit, hold_limit, hold_seconds, resolve_auto
from sgl_ragged.tp import resolve_rank_profiles

logger = logging.getLogger(__name__)

ACTIVE_ENV = "RAGGED_ACTIVE"


def is_active() -> bool:
    """Whether this process serves with the ragged backend (set at resolution, inherited)."""
    return os.environ.get(ACTIVE_ENV) == "1"


def after_add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ServerArgs.add_cli_args."""
    if not any(a.dest == "ragged_profile" for a in parser._actions):
        add_cli_args(parser)


def before_from_cli_args(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ServerArgs.from_cli_args: our flags leave the namespace for the env."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, argparse.Namespace):
            move_cli_args_to_env(arg)


def resolve_ragged_args(server_args: Any, previous: Any) -> None:
    """Resolution hook around handle_attention_backend_compatibility."""
    previous(server_args)
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    cfg = resolving_view(server_args)
    cpu_lora.resolve(server_args, cfg)  # every server of the environment
    if "ragged" not in (cfg.attention_backend, cfg.prefill_attention_backend, cfg.decode_attention_backend):
        os.environ.pop(ACTIVE_ENV, None)
        return
    config = RaggedConfig.from_env()
    _check_unsupported(cfg)
    shape = model_shape(cfg.model_path, bool(cfg.trust_remote_code))
    _check_model(shape, config, cfg.tp_size or 1)
    _check_pipeline(cfg)
    decode_graphs = _decode_graphs(cfg, config, shape.head_dim)
    declare_resolution(
        server_args,
        "sgl_ragged",
        attention_backend="ragged",
        prefill_attention_backend="ragged",
        decode_attention_backend="ragged",
        page_size=cfg.page_size or DEFAULT_PAGE_SIZE,
        max_running_requests=cfg.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        cuda_graph_config=_graph_config(cfg.cuda_graph_config, decode_graphs),
        **({} if decode_graphs else {"disable_cuda_graph": True}),
    )
    os.environ[ACTIVE_ENV] = "1"
    logger.info("ragged backend: profile %s, precision %s, rotation %s, scorer %s, window %d "
                "page(s)", config.profile, config.precision, config.rotation, config.scorer,
                config.window_pages)


def _decode_graphs(cfg: Any, config: RaggedConfig, head_dim: int | None = None) -> bool:
    """Whether decode keeps SGLang's CUDA graphs: only the Triton kernels run under them
    (attention_backend/graph.py), so only on CUDA, not with --ragged-attention batched or
    reference or the dynamic reference mode, not where the Triton kernels refuse the
    precision for this head_dim (`triton_refuses`; auto falls back to batched), and not where
    the user turned them off."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    graph_config = cfg.cuda_graph_config
    on_cuda = str(cfg.device or "cuda").startswith("cuda")
    if (graph_config is None or graph_config.decode.backend == Backend.DISABLED or not on_cuda
            or config.attention not in ("auto", "triton")
            or model_free_kind(config.profile) is ModelFreeKind.DYNAMIC
            or (head_dim is not None and triton_refuses(head_dim, config.precision))):
        return False
    if graph_config.decode.backend != Backend.FULL:
        raise ValueError(
            f"--cuda-graph-backend-decode {graph_config.decode.backend} is not supported by the "
            "ragged backend; use full (the default) or disabled"
        )
    if os.environ.get("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "").lower() in ("1", "true", "yes"):
        raise ValueError(
            "SGLANG_ENABLE_METADATA_GLUE_GRAPH captures the attention metadata preparation into "
            "a graph, but the ragged backend plans each decode step on the host (staging pages, "
            "seal lists); unset it, or pass --cuda-graph-backend-decode disabled"
        )
    return True


def _graph_config(graph_config: Any, decode: bool) -> Any:
    """SGLang's CUDA graph config with prefill graphs off (extend batches plan on the host
    per chunk) and decode graphs off unless `decode`."""
    from sglang.srt.model_executor.cuda_graph_config import (
        Backend,
        CudaGraphConfig,
        Phase,
        with_phase,
    )

    config = with_phase(graph_config or CudaGraphConfig(), Phase.PREFILL, backend=Backend.DISABLED)
    return config if decode else with_phase(config, Phase.DECODE, backend=Backend.DISABLED)


def validate_ragged_args(server_args: Any, previous: Any) -> None:
    """Resolution hook around handle_other_validations: checks needing final values."""
    previous(server_args)
    cpu_gemm.validate()  # RAGGED_CPU_GEMM, RAGGED_CPU_OPS and the native pool's settings are
    cpu_ops.validate()  # read by every server of the environment
    native_pool.validate()
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    _check_history_holds(cfg)  # any backend
    if not is_active():
        return
    chunk = cfg.chunked_prefill_size
    if chunk is not None and chunk > 0 and chunk % cfg.page_size != 0:
        raise ValueError(
            f"--chunked-prefill-size {chunk} is not a multiple of --page-size {cfg.page_size}: "
            "the ragged backend compresses whole pages, so every prefill chunk must end on a page "
            f"boundary; use e.g. --chunked-prefill-size {max(1, chunk // cfg.page_size) * cfg.page_size}"
        )


def _check_history_holds(cfg: Any) -> None:
    """--ragged-hold-history: auto resolved for this server, given seconds only where one
    scheduler decides alone."""
    one_rank = (cfg.tp_size or 1) == 1 and (cfg.pp_size or 1) == 1
    hold_limit()  # a clear error at launch, not in the scheduler
    auto = resolve_auto(is_active(), one_rank)
    if not explicit():
        if auto:
            logger.info("--ragged-hold-history auto: holding finished conversations for %g s "
                        "while they come back", auto)
        return
    if hold_seconds() <= 0:
        return
    for flag, size in (("--tp-size", cfg.tp_size), ("--pp-size", cfg.pp_size)):
        if (size or 1) > 1:
            raise ValueError(
                f"--ragged-hold-history is not supported with {flag} {size}: each rank would "
                "end its holds by its own clock and the ranks' schedules would part; serve "
                "replicas (--dp-size, or sglang_router) with it, or drop the flag (auto leaves "
                "holds off there)"
            )


# --kv-cache-dtype values that keep the model's 16-bit rows (the ragged storage's input).
DENSE_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")
# Features that copy or send KV pages by SGLang's dense pool layout: (flag, ServerArgs field).
KV_MOVING_FEATURES = (
    ("--enable-hierarchical-cache", "enable_hierarchical_cache"),
    ("--hicache-storage-backend", "hicache_storage_backend"),
    ("--disaggregation-mode", "disaggregation_mode"),
    ("--enable-lmcache", "enable_lmcache"),
    ("--enable-flexkv", "enable_flexkv"),
)


def _check_unsupported(cfg: Any) -> None:
    if cfg.speculative_algorithm:
        raise ValueError("--attention-backend ragged does not support speculative decoding yet")
    if getattr(cfg, "enable_dp_attention", False):
        raise ValueError(
            "--enable-dp-attention is not supported by --attention-backend ragged (its attention "
            "ranks would need their own profile slices); use --dp-size without it, --tp-size, or "
            "replicas behind sglang_router (README, 'Scaling out')"
        )
    if getattr(cfg, "enable_torch_compile", False):
        raise ValueError(
            "--enable-torch-compile is not supported by --attention-backend ragged (each step is "
            "planned on the host, and the CPU graph runner it enables has no ragged support); "
            "drop the flag (decode CUDA graphs stay on without it)"
        )
    kv_dtype = getattr(cfg, "kv_cache_dtype", "auto")
    if kv_dtype not in DENSE_KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_dtype} is SGLang's own quantized KV cache, but the ragged "
            "backend stores and quantizes its rows itself; keep --kv-cache-dtype auto and pick "
            "the rows' precision with --ragged-precision (fp8, int8, int4, int2, mixed, or a "
            "high+low pair such as int8+int4: README, 'What to serve per budget')"
        )
    for flag, attr in KV_MOVING_FEATURES:
        value = getattr(cfg, attr, None)
        if value not in (None, False, "null"):
            raise ValueError(
                f"{flag} is not supported by --attention-backend ragged: it moves KV pages in "
                "SGLang's dense layout (k_buffer / v_buffer per layer), but the ragged pool "
                "stores each head's compressed rows in its own storage; drop the flag"
            )
    if cfg.page_size is not None and cfg.page_size < 4:
        raise ValueError(
            f"--page-size {cfg.page_size} is too small for the ragged backend: a page is the "
            "compression block and must hold the 4 sink tokens; use --page-size 64 (default)"
        )


def _check_pipeline(cfg: Any) -> None:
    """--pp-size > 1 on a checkpoint SGLang's pipeline stages can serve: not one that ties its
    word embeddings (the last stage's lm_head would be the first stage's embedding, which only
    the first stage holds: SGLang 0.5.23's forward fails there with stock backends too)."""
    pp_size = getattr(cfg, "pp_size", 1) or 1
    if pp_size == 1:
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model_path, trust_remote_code=bool(cfg.trust_remote_code))
    if any(getattr(c, "tie_word_embeddings", False) for c in (hf, getattr(hf, "text_config", hf))):
        raise ValueError(
            f"--pp-size {pp_size} cannot serve {cfg.model_path}: it ties its word embeddings "
            "(tie_word_embeddings), and in SGLang 0.5.23's pipeline stages the last stage's "
            "lm_head is the embedding that only the first stage holds (its first forward fails "
            "with \"'PPMissingLayer' object has no attribute 'quant_method'\", with any attention "
            "backend); use --tp-size or --dp-size, or a checkpoint with its own lm_head"
        )


def _check_model(shape: ModelShape, config: RaggedConfig, tp_size: int) -> None:
    if shape.architecture not in SERVED_ARCHITECTURES:
        raise ValueError(
            f"--attention-backend ragged does not support {shape.architecture} yet; supported "
            f"architectures (dense attention): {', '.join(SERVED_ARCHITECTURES)}"
        )
    # Every rank's slice, so that a --tp-size the profile cannot be split by fails here.
    resolve_rank_profiles(config.profile, shape, config.heads_per_group, tp_size)
    parsed = tier_precision(config.precision)
    for fmt in (f for f in (parsed.high, parsed.low) if f is not None):
        if (shape.head_dim * fmt.bits) % 8 == 0:
            continue
        raise ValueError(f"--ragged-precision {fmt.name} packs {8 // fmt.bits} channels per byte, "
                         f"but head_dim {shape.head_dim} is not a multiple of {8 // fmt.bits}; "
                         "use int8 or fp8")
