"""Servers the multi-turn harness launches itself, all at the same KV memory budget.

The budget is given in tokens of stock SGLang (`--kv-budget-tokens T`: the bytes an
uncompressed pool of T tokens takes). The baseline (`torch_native`) gets
`--max-total-tokens T`; a ragged server gets the logical tokens that fit in the same bytes
once its staging pool is taken out, computed with the plugin's own layout arithmetic
(`RaggedLayout.num_logical_pages`, as `calculate_pool_sizes` does at startup). Explicit token
caps instead of `--mem-fraction-static` keep the runs reproducible on a CPU host, whose free
memory changes under other processes; bench/capacity.py measures the same equality the other
way round (same fraction, compare the tokens each server reports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import ModelShape, model_shape, resolve_profile

PAGE = 64
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Target:
    """A deployment to launch: `baseline` (stock torch_native), `ragged:<profile>`,
    `ragged@<precision>:<profile>` (row tiers, --ragged-precision), or
    `router:<N>:<policy>:<either>` (N such workers behind SGLang's router with that policy)."""

    label: str
    profile: str | None  # None: the baseline
    precision: str = "bf16"  # --ragged-precision of ragged workers
    workers: int = 1  # > 1 or a policy: behind sglang_router
    policy: str | None = None  # router policy (sgl_ragged.testing.router.POLICIES)

    @classmethod
    def parse(cls, spec: str) -> Target:
        kind, _, rest = spec.partition(":")
        if kind == "router":
            return cls._parse_router(spec, rest)
        kind, _, precision = kind.partition("@")
        if kind == "baseline" and not rest and not precision:
            return cls("baseline", None)
        if kind == "ragged" and rest:
            if precision:
                from sgl_ragged.precision import tier_precision

                tier_precision(precision)  # raises for an unknown one
            return cls(spec, rest, precision or "bf16")
        raise ValueError(f"--launch {spec!r}: use 'baseline', 'ragged:<profile>' or "
                         "'ragged@<precision>:<profile>' (e.g. ragged:uniform:0.3, "
                         "ragged@int4:uniform:0.3 or ragged:calib_profiles/x.json) or "
                         "'router:<N>:<policy>:baseline|ragged:<profile>'")

    @classmethod
    def _parse_router(cls, spec: str, rest: str) -> Target:
        from sgl_ragged.testing.router import POLICIES

        count, _, rest = rest.partition(":")
        policy, _, inner = rest.partition(":")
        if not count.isdigit() or int(count) < 1 or policy not in POLICIES or not inner:
            raise ValueError(f"--launch {spec!r}: use router:<N>:<policy>:<target> with N >= 1, "
                             f"policy one of {', '.join(POLICIES)} and target 'baseline' or "
                             "'ragged:<profile>' (e.g. router:2:cache_aware:ragged:uniform:0.3)")
        worker = cls.parse(inner)
        return cls(f"router:{count}:{policy}:{worker.label}", worker.profile, worker.precision,
                   int(count), policy)


def kv_geometry(model: str) -> tuple[ModelShape, int]:
    """The KV shape (as the server fingerprints it) and KV dtype bytes of a local checkpoint."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return model_shape(model), DTYPE_BYTES.get(str(dtype), 2)


class Budget(NamedTuple):
    """What a target gets at the common KV budget."""

    kv_tokens: int  # --max-total-tokens: logical tokens
    rho: float  # target retention (1.0: baseline; a profile's recorded rho, else its mean budget)
    retention: float  # effective: bytes of a compressed page over a full one


def equal_budget(target: Target, model: str, baseline_tokens: int, max_running: int,
                 window_pages: int = 1) -> Budget:
    """The logical tokens `target` holds in the bytes of `baseline_tokens` full tokens."""
    if target.profile is None:
        return Budget(baseline_tokens, 1.0, 1.0)
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


def launch_args(target: Target, model: str, kv_tokens: int, *, max_running: int, chunk: int,
                device: str, extra: list[str]) -> list[str]:
    """`launch_server` arguments for `target` (host and port are added by ServerProcess)."""
    common = ["--model-path", model, "--device", device, "--page-size", str(PAGE),
              "--chunked-prefill-size", str(chunk), "--max-running-requests", str(max_running),
              "--max-total-tokens", str(kv_tokens), "--enable-metrics", "--enable-cache-report"]
    if target.profile is None:
        return [*common, "--attention-backend", "torch_native", *extra]
    return [*common, "--attention-backend", "ragged", "--ragged-profile", target.profile,
            "--ragged-precision", target.precision, *extra]
