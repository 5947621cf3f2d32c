"""SGLang plugin entry point (group `sglang.srt.plugins`): registers the `ragged` backend.

Importing this module changes nothing; SGLang calls `register()` once in every process
(launcher, scheduler, detokenizer), and only then are hooks installed.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_ragged.compat.sgl_kernel_cpu import install_if_needed

_SRT = "sglang.srt"
_POOL_CONFIGURATOR = f"{_SRT}.model_executor.pool_configurator.DefaultPoolConfigurator"
_PLATFORM = f"{_SRT}.platforms.interface.SRTPlatform"
_OPENAI = f"{_SRT}.entrypoints.openai"
_ENGINE = f"{_SRT}.entrypoints.engine.Engine"
_TREES = (f"{_SRT}.mem_cache.unified_radix_cache.UnifiedRadixCache", f"{_SRT}.mem_cache.radix_cache.RadixCache")


def register() -> None:
    """Add `ragged` to --attention-backend and install the hooks it needs."""
    install_if_needed()  # pure-torch CPU ops where the real sgl_kernel cannot load
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from sgl_ragged.serving import engine_args, server_args
    from sgl_ragged.serving.backend import create_ragged_backend

    if "ragged" not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices(["ragged"])
    register_attention_backend("ragged")(create_ragged_backend)
    register_resolution_hook("handle_attention_backend_compatibility")(server_args.resolve_ragged_args)
    register_resolution_hook("handle_other_validations")(server_args.validate_ragged_args)
    for target, hook, kind in hook_table():
        HookRegistry.register(target, hook, kind)
    engine_args.install()  # sglang.Engine(ragged_profile=...) in a process that built one
    if multiprocessing.parent_process() is None:  # the HTTP server's process, not a child
        for target, hook, kind in guard_hook_table():
            HookRegistry.register(target, hook, kind)


def hook_table() -> list[tuple[str, Callable[..., Any], HookType]]:
    """(dotted SGLang target, hook, kind) of every hook register() installs."""
    from sgl_ragged.compat import (
        cpu_gemm,
        cpu_lora,
        cpu_ops,
        cpu_start,
        cpu_tp,
        cpu_triton,
        shared_tokenizer,
    )
    from sgl_ragged.serving import history_holds, server_args
    from sgl_ragged.serving import scheduler_hooks as hooks

    return [
        (f"{_SRT}.server_args.ServerArgs.add_cli_args", server_args.after_add_cli_args, HookType.AFTER),
        (f"{_SRT}.server_args.ServerArgs.from_cli_args", server_args.before_from_cli_args, HookType.BEFORE),
        (f"{_POOL_CONFIGURATOR}._compute_cell_size", hooks.compute_cell_size, HookType.AROUND),
        (f"{_POOL_CONFIGURATOR}.calculate_pool_sizes", hooks.calculate_pool_sizes, HookType.AROUND),
        (f"{_PLATFORM}.get_kv_pool_cls", hooks.kv_pool_cls, HookType.AROUND),
        (f"{_PLATFORM}.get_paged_allocator_cls", hooks.paged_allocator_cls, HookType.AROUND),
        (f"{_SRT}.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
         hooks.after_prepare_for_extend, HookType.AFTER),
        (f"{_SRT}.model_executor.forward_batch_info.ForwardBatch.init_new",
         hooks.after_forward_batch_init, HookType.AFTER),
        (f"{_SRT}.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
         hooks.after_decode_graph_replay, HookType.AFTER),
        (f"{_SRT}.model_executor.model_runner.ModelRunner._extend_forward_kwargs",
         hooks.extend_forward_kwargs, HookType.AROUND),
        (f"{_SRT}.models.utils.enable_fused_set_kv_buffer", hooks.fused_set_kv_buffer,
         HookType.AROUND),
        *((f"{tree}.checkpoint", hooks.checkpoint, HookType.AROUND) for tree in _TREES),
        *((f"{tree}.checkpoint", history_holds.after_checkpoint, HookType.AFTER) for tree in _TREES),
        *((f"{tree}.reset", history_holds.after_reset, HookType.AFTER) for tree in _TREES),
        (f"{_SRT}.managers.scheduler.Scheduler.get_new_batch_prefill",
         history_holds.around_get_new_batch_prefill, HookType.AROUND),
        (f"{_SRT}.managers.schedule_batch.ScheduleBatch.check_decode_mem",
         history_holds.around_check_decode_mem, HookType.AROUND),
        (f"{_SRT}.distributed.parallel_state.init_model_parallel_group",
         cpu_tp.init_model_parallel_group, HookType.AROUND),
        (f"{_SRT}.layers.quantization.unquant.UnquantizedLinearMethod.apply", cpu_gemm.apply,
         HookType.AROUND),
        (f"{_SRT}.layers.logits_processor.LogitsProcessor._compute_lm_head",
         cpu_gemm.compute_lm_head, HookType.AROUND),
        (f"{_SRT}.layers.layernorm.RMSNorm.forward_native", cpu_ops.rms_norm_native,
         HookType.AROUND),
        (f"{_SRT}.layers.rotary_embedding.base.RotaryEmbedding.forward_native",
         cpu_ops.rotary_native, HookType.AROUND),
        (cpu_triton.TARGET, cpu_triton.gate_sigmoid_mul, HookType.AROUND),
        (f"{_SRT}.model_executor.model_runner.ModelRunner.init_lora_manager",
         cpu_lora.init_lora_manager, HookType.AROUND),
        *((f"{_ENGINE}.{launch}", cpu_start.launch_processes, HookType.AROUND)
          for launch in ("_launch_scheduler_processes", "_launch_detokenizer_subprocesses")),
        (f"{_SRT}.managers.scheduler.Scheduler.__init__", shared_tokenizer.share_tokenizers,
         HookType.AROUND),
    ]


def guard_hook_table() -> list[tuple[str, Callable[..., Any], HookType]]:
    """The request guard's hooks (serving/guard_hooks.py, over sgl_ragged/guard), installed in the main process only: it is
    where requests arrive, and its targets would import the HTTP server into the children."""
    from sgl_ragged.serving import guard_hooks as hooks

    return [
        (f"{_SRT}.entrypoints.http_server.serve_generate_request", hooks.around_serve_generate,
         HookType.AROUND),
        (f"{_OPENAI}.serving_chat.OpenAIServingChat._convert_to_internal_request",
         hooks.after_convert_chat, HookType.AFTER),
        (f"{_OPENAI}.serving_completions.OpenAIServingCompletion._convert_to_internal_request",
         hooks.after_convert_completion, HookType.AFTER),
        (f"{_SRT}.managers.tokenizer_manager.TokenizerManager._validate_one_request",
         hooks.before_validate_one_request, HookType.BEFORE),
    ]
