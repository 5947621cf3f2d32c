"""Servers the multi-turn harness launches itself, all at the same KV memory budget.

The budget is given in tokens of stock SGLang (`--kv-budget-tokens T`: the bytes an
uncompressed pool of T tokens takes). The baseline (stock `torch_native` on the CPU, `triton` on
CUDA) gets `--max-total-tokens T`; stock with a narrower KV cache dtype (`baseline@fp8_e4m3`) the
tokens of its entry size in the same bytes (T x 2 for 1-byte entries of a bfloat16 model); a
ragged server gets the logical tokens that fit in the same bytes once its staging pool is taken
out, computed with the plugin's own layout arithmetic (`RaggedLayout.num_logical_pages`, as
`calculate_pool_sizes` does at startup). Explicit token caps instead of `--mem-fraction-static`
keep the runs reproducible on a CPU host, whose free memory changes under other processes, and
hold on a GPU as well (SGLang takes the smaller of the cap and what memory allows);
bench/capacity.py measures the same equality the other way round (same fraction, compare the
tokens each server reports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import ModelShape, model_shape, resolve_profile

PAGE = 64
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Bytes per KV entry of stock SGLang 0.5.23's `--kv-cache-dtype` values whose pool is one plain
# tensor per layer (1-byte fp8 codes plus a per-layer scale). Its other values: `auto` is the plain
# baseline; mxfp8, nvfp4 and fp4_mx_block16 keep block scales beside the codes, not counted here.
STOCK_KV_BYTES = {"bf16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# Stock SGLang's attention backend for the baseline, by --device.
STOCK_BACKEND = {"cpu": "torch_native", "cuda": "triton"}
# SGLang 0.5.23 stores fp8_e4m3 KV entries on a CPU only for its intel_amx attention backend,
# which needs AMX and sgl-kernel's CPU build (PyPI's wheel lacks it: such a server stops at
# startup in this environment, "CPU FP8 KV cache requires Intel AMX support.").
STOCK_CPU_FP8_BACKEND = "intel_amx"


def stock_backend(device: str, kv_dtype: str | None = None) -> str:
    """Stock SGLang's attention backend on `device` for its `--kv-cache-dtype` (None or auto:
    the model's dtype)."""
    if device == "cpu" and kv_dtype == "fp8_e4m3":
        return STOCK_CPU_FP8_BACKEND
    return STOCK_BACKEND[device]


# What every server needs on a lent GPU machine without the sgl-kernel wheel (docs/gpu_serving.md):
# norms, activations and rotary embedding on their torch forward_native, no version check of the
# absent package, SGLang's CUDA platform (testing.server sets the CPU engine), and the radix
# tree's pure-Python core: the Rust one (the only extension in SGLang's wheel that links
# libtorch) is built against torch 2.14 and, under the machine's torch 2.11, read the int64 token
# slots it is handed as uint8 and stopped the scheduler at the first prefill ("insert value must
# be an int64 tensor, got Uint8"; seen on the CPU in a copy of the machine's packages) ...
GPU_ENV = {"SGLANG_USE_CPU_ENGINE": "0", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
           "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
           "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
# ... and its arguments: torch sampling (no FlashInfer kernels), no grammar backend, prefill CUDA
# graphs off (the ragged backend plans each chunk on the host; stock runs the same way).
GPU_ARGS = ("--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--cuda-graph-backend-prefill", "disabled")


@dataclass(frozen=True)
class Target:
    """A deployment to launch: `baseline` (stock torch_native on the CPU, triton on CUDA),
    `baseline@<kv dtype>` (stock with --kv-cache-dtype, STOCK_KV_BYTES), `ragged:<profile>`,
    `ragged@<precision>:<profile>` (row tiers, --ragged-precision; a trailing r, as in
    `ragged@int4r:uniform:0.3`, also stores them rotated: --ragged-rotation hadamard), or
    `router:<N>:<policy>:<either>` (N such workers behind SGLang's router with that policy).
    Words after the target are launch_server arguments of this target alone (after those every
    launch gets), and stay in its label: `ragged:uniform:0.3 --ragged-hold-history 2` beside
    `ragged:uniform:0.3` compares a flag on and off in one run."""

    label: str
    profile: str | None  # None: stock SGLang
    precision: str = "bf16"  # --ragged-precision of ragged workers
    workers: int = 1  # > 1 or a policy: behind sglang_router
    policy: str | None = None  # router policy (sgl_ragged.testing.router.POLICIES)
    kv_dtype: str | None = None  # stock's --kv-cache-dtype; None: the model's dtype
    rotated: bool = False  # ragged workers' --ragged-rotation hadamard
    extra: tuple[str, ...] = ()  # launch_server arguments of this target alone

    @classmethod
    def parse(cls, spec: str) -> Target:
        try:
            words = shlex.split(spec)
        except ValueError as exc:
            raise ValueError(f"--launch {spec!r}: {exc} (quote a target and its arguments as "
                             "one shell word)") from None
        if not words:
            raise ValueError("--launch '': give a target, e.g. baseline or ragged:uniform:0.3")
        target = cls._parse_target(words[0])
        if len(words) == 1:
            return target
        if not words[1].startswith("--"):
            raise ValueError(f"--launch {spec!r}: after the target come launch_server arguments "
                             f"(--flag or --flag=value), not {words[1]!r}")
        return dataclasses.replace(target, label=shlex.join(words), extra=tuple(words[1:]))

    @classmethod
    def _parse_target(cls, spec: str) -> Target:
        kind, _, rest = spec.partition(":")
        if kind == "router":
            return cls._parse_router(spec, rest)
        kind, _, variant = kind.partition("@")
        if kind == "baseline" and not rest:
            return cls._parse_stock(spec, variant)
        if kind == "ragged" and rest:
            if not variant:
                return cls(spec, rest)
            from bench.accuracy_configs import split_rotated
            from sgl_ragged.precision import tier_precision

            precision, rotated = split_rotated(variant)
            tier_precision(precision)  # raises for an unknown one
            return cls(spec, rest, precision, rotated=rotated)
        raise ValueError(f"--launch {spec!r}: use 'baseline', 'baseline@<kv dtype>', "
                         "'ragged:<profile>' or 'ragged@<precision>:<profile>' (e.g. "
                         "baseline@fp8_e4m3, ragged:uniform:0.3, ragged@int4:uniform:0.3 or "
                         "ragged:calib_profiles/x.json) or "
                         "'router:<N>:<policy>:baseline|ragged:<profile>'")

    @classmethod
    def _parse_stock(cls, spec: str, kv_dtype: str) -> Target:
        if not kv_dtype:
            return cls("baseline", None)
        if kv_dtype not in STOCK_KV_BYTES:
            raise ValueError(f"--launch {spec!r}: unknown stock KV cache dtype {kv_dtype!r}; use "
                             f"one of {', '.join(STOCK_KV_BYTES)} (plain 'baseline' is SGLang's "
                             "'auto'; mxfp8, nvfp4 and fp4_mx_block16 keep block scales that "
                             "the equal-bytes budget does not count)")
        return cls(spec, None, kv_dtype=kv_dtype)

    @classmethod
    def _parse_router(cls, spec: str, rest: str) -> Target:
        from sgl_ragged.testing.router import POLICIES

        count, _, rest = rest.partition(":")
        policy, _, inner = rest.partition(":")
        if not count.isdigit() or int(count) < 1 or policy not in POLICIES or not inner:
            raise ValueError(f"--launch {spec!r}: use router:<N>:<policy>:<target> with N >= 1, "
                             f"policy one of {', '.join(POLICIES)} and target 'baseline' or "
                             "'ragged:<profile>' (e.g. router:2:cache_aware:ragged:uniform:0.3)")
        worker = cls._parse_target(inner)
        return cls(f"router:{count}:{policy}:{worker.label}", worker.profile, worker.precision,
                   int(count), policy, worker.kv_dtype, worker.rotated)


def kv_geometry(model: str) -> tuple[ModelShape, int]:
    """The KV shape (as the server fingerprints it) and KV dtype bytes of a local checkpoint."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return model_shape(model), DTYPE_BYTES.get(str(dtype), 2)


class Budget(NamedTuple):
    """What a target gets at the common KV budget."""

    kv_tokens: int  # --max-total-tokens: logical tokens
    rho: float  # target retention (1.0: stock; a profile's recorded rho, else its mean budget)
    retention: float  # effective: bytes of a compressed page over a full one


def equal_budget(target: Target, model: str, baseline_tokens: int, max_running: int,
                 window_pages: int = 1) -> Budget:
    """The logical tokens `target` holds in the bytes of `baseline_tokens` full tokens."""
    if target.profile is None:
        return stock_budget(target, model, baseline_tokens)
    shape, dtype_bytes = kv_geometry(model)
    profile = resolve_profile(target.profile, shape)
    layout = RaggedLayout.from_profile(profile, PAGE, shape.head_dim, dtype_bytes, target.precision)
    budget = baseline_tokens // PAGE * layout.full_bytes_per_page
    staging = (max_running + 1) * (window_pages + 1)
    pages = layout.num_logical_pages(budget, staging)
    if pages < 1:
        raise ValueError(f"--kv-budget-tokens {baseline_tokens} leaves nothing for {target.label} "
                         f"once its {staging} staging pages are taken out; raise it or lower "
                         "--max-running-requests")
    rho = float(profile.source.get("rho") or profile.mean_budget)
    return Budget(pages * PAGE, rho, layout.retention)


def stock_budget(target: Target, model: str, baseline_tokens: int) -> Budget:
    """Stock SGLang keeps every token; with a KV cache dtype narrower than the model's, the same
    bytes hold more of them (whole pages: SGLang's pool stores K and V of every layer and head
    at that dtype, one per-layer scale aside)."""
    if target.kv_dtype is None:
        return Budget(baseline_tokens, 1.0, 1.0)
    _, dtype_bytes = kv_geometry(model)
    entry = STOCK_KV_BYTES[target.kv_dtype]
    tokens = baseline_tokens * dtype_bytes // entry // PAGE * PAGE
    return Budget(tokens, 1.0, entry / dtype_bytes)


def launch_env(device: str) -> dict[str, str]:
    """Environment entries every launched server gets (ServerProcess's `env`) on `device`."""
    _check_device(device)
    return dict(GPU_ENV) if device == "cuda" else {}


def launch_args(target: Target, model: str, kv_tokens: int, *, max_running: int, chunk: int,
                device: str, extra: list[str]) -> list[str]:
    """`launch_server` arguments for `target` on `device` (host and port are added by
    ServerProcess, and `--sleep-on-idle` on the CPU); on CUDA, GPU_ARGS and decode CUDA graphs
    up to the running-request cap (fewer captures: a faster start); `extra` (every launch's),
    then the target's own."""
    _check_device(device)
    common = ["--model-path", model, "--device", device, "--page-size", str(PAGE),
              "--chunked-prefill-size", str(chunk), "--max-running-requests", str(max_running),
              "--max-total-tokens", str(kv_tokens), "--enable-metrics", "--enable-cache-report"]
    if device == "cuda":
        common += [*GPU_ARGS, "--cuda-graph-max-bs-decode", str(max_running)]
    if target.profile is None:
        kv = ["--kv-cache-dtype", target.kv_dtype] if target.kv_dtype else []
        return [*common, "--attention-backend", stock_backend(device, target.kv_dtype), *kv,
                *extra, *target.extra]
    rotation = "hadamard" if target.rotated else "none"  # as labelled, never a profile's auto
    return [*common, "--attention-backend", "ragged", "--ragged-profile", target.profile,
            "--ragged-precision", target.precision, "--ragged-rotation", rotation, *extra,
            *target.extra]


def _check_device(device: str) -> None:
    if device not in STOCK_BACKEND:
        raise ValueError(f"--device {device!r}: the harness launches servers on "
                         f"{' or '.join(STOCK_BACKEND)}")


def start_all(stack: contextlib.ExitStack, server_args: Sequence[str],
              runs: Sequence[tuple[str, dict[str, str], Path]],
              startup_timeout: float = 900) -> list[str]:
    """Start one server per run (what to print while it starts, its environment, its log),
    each alive until `stack` closes, one after the other (a start is a minute or more of
    single-threaded imports); their base URLs, in order. For A/B benchmarks whose servers are
    all alive at once and measured in alternating rounds (cpu_sweep.round_order)."""
    from sgl_ragged.testing import ServerProcess

    urls = []
    for i, (what, env, log) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {what}: starting the server ...", flush=True)
        urls.append(stack.enter_context(ServerProcess(list(server_args), env=env, log_path=log,
                                                      startup_timeout=startup_timeout)).base_url)
    return urls
