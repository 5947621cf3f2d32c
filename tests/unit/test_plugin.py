"""The plugin's hooks point at SGLang code that exists in the pinned version, and fit it.

HookRegistry patches targets by dotted path when plugins load; a renamed SGLang method would
leave its hook silently unapplied in some process, and a changed signature would make the hook
raise TypeError on every call. Every target must resolve to a callable whose arguments the
hook accepts in the form its hook type passes them.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang.srt.plugins.hook_registry import HookType  # noqa: E402

from sgl_ragged.serving.plugin import guard_hook_table, hook_table  # noqa: E402

ALL_HOOKS = hook_table() + guard_hook_table()


def _resolve(target: str) -> object:
    """The attribute a dotted path names: the longest importable module, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def _call(target: object, kind: HookType) -> tuple[list[object], dict[str, object]]:
    """Placeholder arguments as HookRegistry's wrapper hands them to the hook: the target's
    required parameters (self included; keyword-only ones by name), after the original function
    (AROUND) or its result (AFTER)."""
    params = [p for p in inspect.signature(target).parameters.values() if p.default is p.empty]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: object() for p in params if p.kind == p.KEYWORD_ONLY}
    lead = {HookType.AROUND: [target], HookType.AFTER: [None]}.get(kind, [])
    return [*lead, *(object() for _ in positional)], keywords


@pytest.mark.parametrize("target,hook,kind", ALL_HOOKS, ids=[t for t, _, _ in ALL_HOOKS])
def test_hook_fits_its_target(target, hook, kind):
    original = _resolve(target)
    assert callable(original), target
    args, kwargs = _call(original, kind)
    inspect.signature(hook).bind(*args, **kwargs)  # TypeError if it does not fit


def test_async_targets_get_async_hooks():
    """An AROUND hook on a coroutine function must return an awaitable (it is awaited)."""
    for target, hook, kind in ALL_HOOKS:
        if kind == HookType.AROUND and inspect.iscoroutinefunction(_resolve(target)):
            assert inspect.iscoroutinefunction(hook), target


@pytest.mark.parametrize("field, value, message", [
    ("kv_cache_dtype", "fp8_e4m3", "--kv-cache-dtype fp8_e4m3 is SGLang's own quantized KV cache"),
    ("kv_cache_dtype", "nvfp4", "keep --kv-cache-dtype auto"),
    ("enable_hierarchical_cache", True, "--enable-hierarchical-cache is not supported"),
    ("hicache_storage_backend", "file", "--hicache-storage-backend is not supported"),
    ("disaggregation_mode", "prefill", "--disaggregation-mode is not supported"),
    ("enable_lmcache", True, "--enable-lmcache is not supported"),
    ("enable_flexkv", True, "--enable-flexkv is not supported"),
])
def test_server_args_reject_features_the_ragged_pool_cannot_serve(field, value, message):
    """SGLang features that quantize or move KV pages in its dense layout fail at startup with
    the flag named; their defaults (and a 16-bit --kv-cache-dtype) pass."""
    pytest.importorskip("sglang")
    from sgl_ragged.serving.server_args import _check_unsupported

    defaults = dict(speculative_algorithm=None, tp_size=1, page_size=64, enable_torch_compile=False,
                    kv_cache_dtype="auto", pp_size=1, enable_hierarchical_cache=False,
                    hicache_storage_backend=None, disaggregation_mode="null", enable_lmcache=False,
                    enable_flexkv=False)
    _check_unsupported(SimpleNamespace(**defaults))
    _check_unsupported(SimpleNamespace(**{**defaults, "kv_cache_dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=re.escape(message)):
        _check_unsupported(SimpleNamespace(**{**defaults, field: value}))


def test_refused_fields_are_sglang_server_args():
    """Every field the refusals read is a ServerArgs field of the pinned SGLang, with the
    default the check lets through (a renamed flag would silently stop being refused)."""
    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    from sgl_ragged.serving.server_args import DENSE_KV_CACHE_DTYPES, KV_MOVING_FEATURES

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    fields = {a.dest: a.default for a in parser._actions}
    for _, attr in KV_MOVING_FEATURES:
        assert attr in fields and fields[attr] in (None, False, "null"), attr
    assert fields["kv_cache_dtype"] in DENSE_KV_CACHE_DTYPES and fields["pp_size"] == 1


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_refuse_tied_word_embeddings(tmp_path, tied: bool):
    """--pp-size > 1 on a checkpoint that ties its word embeddings fails at startup with the
    reason (SGLang's last stage has no embedding to use as its lm_head); an untied one, or
    --pp-size 1, passes."""
    from types import SimpleNamespace

    pytest.importorskip("sglang")
    from transformers import LlamaConfig

    from sgl_ragged.serving.server_args import _check_pipeline

    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                tie_word_embeddings=tied, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    args = dict(model_path=str(tmp_path), trust_remote_code=False)
    _check_pipeline(SimpleNamespace(**args, pp_size=1))
    if not tied:
        _check_pipeline(SimpleNamespace(**args, pp_size=2))
        return
    with pytest.raises(ValueError, match=r"--pp-size 2 cannot serve .*ties its word embeddings"):
        _check_pipeline(SimpleNamespace(**args, pp_size=2))


def _sglang_extend_kwargs(runner, forward_batch, pp_proxy_tensors):
    """What SGLang 0.5.23's ModelRunner._extend_forward_kwargs makes of a batch's embeddings."""
    kwargs = {}
    if forward_batch.input_embeds is not None:
        kwargs["input_embeds"] = forward_batch.input_embeds.bfloat16()
    if forward_batch.replace_embeds is not None and forward_batch.replace_positions is not None:
        kwargs["input_embeds"][forward_batch.replace_positions] = (
            forward_batch.replace_embeds.to(kwargs["input_embeds"].dtype))
    return kwargs


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("replace", [False, True])
def test_input_embeds_reach_the_model_at_its_dtype(monkeypatch, dtype, replace):
    import torch

    from sgl_ragged.serving import scheduler_hooks

    monkeypatch.setattr(scheduler_hooks, "is_active", lambda: True)
    dtype = getattr(torch, dtype)
    embeds = torch.randn(7, 16, dtype=torch.float32)
    overrides = torch.randn(2, 16, dtype=torch.float32)
    batch = SimpleNamespace(input_embeds=embeds, replace_embeds=overrides if replace else None,
                            replace_positions=torch.tensor([1, 5]) if replace else None)
    out = scheduler_hooks.extend_forward_kwargs(
        _sglang_extend_kwargs, SimpleNamespace(dtype=dtype), batch, None)["input_embeds"]
    want = embeds.to(dtype)
    if replace:
        want[[1, 5]] = overrides.to(dtype)
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(batch.input_embeds, embeds)  # the batch's own tensor untouched


def test_input_embeds_pass_through_without_the_ragged_backend(monkeypatch):
    import torch

    from sgl_ragged.serving import scheduler_hooks

    monkeypatch.setattr(scheduler_hooks, "is_active", lambda: False)
    batch = SimpleNamespace(input_embeds=torch.randn(3, 8), replace_embeds=None,
                            replace_positions=None)
    out = scheduler_hooks.extend_forward_kwargs(
        _sglang_extend_kwargs, SimpleNamespace(dtype=torch.float32), batch, None)
    assert out["input_embeds"].dtype == torch.bfloat16  # SGLang's own


@pytest.mark.parametrize("active", [True, False])
def test_fused_kv_writes_stay_off_the_ragged_pool(monkeypatch, active):
    """On CUDA SGLang's Qwen3-MoE writes K/V into the pool's dense buffers in its rotary
    embedding when `enable_fused_set_kv_buffer` says so; the ragged pool has none."""
    from sgl_ragged.serving import scheduler_hooks

    monkeypatch.setattr(scheduler_hooks, "is_active", lambda: active)
    calls = []
    out = scheduler_hooks.fused_set_kv_buffer(lambda batch: calls.append(batch) or True, "batch")
    assert (out, calls) == ((False, []) if active else (True, ["batch"]))


def _attention_model(**layer_kwargs):
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        RadixAttention(4, 16, 0.25, 2, layer_id=i, **(layer_kwargs if i == 1 else {}))
        for i in range(2))
    return model


def test_plain_causal_attention_layers_pass():
    from sgl_ragged.serving.backend import check_attention_layers

    check_attention_layers(_attention_model())
    check_attention_layers(_attention_model(v_head_dim=16, sliding_window_size=-1, logit_cap=0.0))


@pytest.mark.parametrize("kwargs,message", [
    ({"sliding_window_size": 4095}, "a sliding window"),
    ({"logit_cap": 30.0}, "logit capping"),
    ({"is_cross_attention": True}, "cross-attention"),
    ({"v_head_dim": 8}, "value heads of 8 channels beside keys of 16"),
    ({"pos_encoding_mode": "ALIBI"}, "position encoding ALIBI"),
    ({"sliding_window_size": 512, "logit_cap": 50.0}, "a sliding window and logit capping"),
])
def test_attention_layers_the_backend_does_not_compute_are_refused(kwargs, message):
    from sgl_ragged.serving.backend import check_attention_layers

    with pytest.raises(ValueError, match=rf"layer layers\.1 \(layer 1\) asks for {message}"):
        check_attention_layers(_attention_model(**kwargs))


def test_non_causal_attention_layers_are_refused():
    from sglang.srt.layers.radix_attention import AttentionType

    from sgl_ragged.serving.backend import check_attention_layers

    with pytest.raises(ValueError, match="asks for encoder_only attention"):
        check_attention_layers(_attention_model(attn_type=AttentionType.ENCODER_ONLY))


def test_learned_attention_sinks_are_refused():
    import torch

    from sgl_ragged.serving.backend import _refuse_sinks, check_attention_layers

    model = _attention_model()
    model.layers[1].sinks = torch.nn.Parameter(torch.zeros(4))  # as SGLang's Granite-SWA, gpt-oss
    with pytest.raises(ValueError, match="layers.1 has learned attention sinks"):
        check_attention_layers(model)
    _refuse_sinks({"sinks": None})
    with pytest.raises(ValueError, match="learned attention sinks"):
        _refuse_sinks({"sinks": torch.zeros(4)})
