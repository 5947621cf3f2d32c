"""Offline accuracy of budget configurations: next-token KL and NLL under page compression.

Every configuration of bench.accuracy (full, uniform, the calibrated static profiles, the
equal-memory ones -- static-mean, kvcompose, baklava -- and the dynamic Eq. 3 reference) is run
on the same held-out samples through ``sgl_ragged.emulator.compressed``: one forward per sample
that emulates chunked prefill with the server's page compression (same scorer code, same group
slots), no server. Per sample: the mean over the tokens after the first chunk of
KL(full || config) and of the NLL; the table gives the mean over samples ± its standard error
(samples are the independent units), and paired differences against uniform at the same rho.

Much cheaper per token than bench.accuracy (thousands of scored tokens per configuration in a
few seconds each), but it covers prefill compression only: decode-time sealing and the
multi-turn radix reuse are bench.accuracy's.

``--precision`` takes low precisions (int8 int4 int2 fp8: p@rho, the best tokens at bf16 over a
p remainder, and p-all) and pairs ``hi+lo`` such as ``int8+int4``: ``int8+int4@rho`` spends rho
of the bytes on the most tokens that fit in int4, the best of them upgraded to int8 while the
bytes allow (mem_pool/tiers.py ``compose_mixed``; every tier's scales and zeros counted). The
server stores the pairs --ragged-precision accepts (H int8 or fp8); others (e.g. int4+int2)
are offline only.
A trailing ``r`` (``int4r``, ``int2r``, ``int8+int4r``: ``int4r@rho``, ``int4r-all@r``)
quantizes every quantized tier after a fixed randomized Hadamard rotation per (layer, KV head)
(sgl_ragged/rotation.py, ``TierSelection.rotation``; served: --ragged-rotation hadamard): same
bytes; each rotated row
is paired with its unrotated twin. Every row also gives the top-1 next-token accuracy and the
top-1 agreement with the full cache (the fraction of tokens whose argmax is full's).

``--stock fp8_e4m3 mxfp8 fp4_mx_block16 nvfp4`` adds SGLang's own quantized KV caches,
``sglang-<dtype>``, emulated as SGLang 0.5.23 stores them (emulator/sglang_caches.py) at their
own bytes (scales included); every other configuration is also compared, paired, with each of
them that costs at least its bytes. ``--profile-config NAME=PATH[=PRECISION]`` adds a profile
file as is (e.g. per-head precision from ``sgl-ragged profile tiers``), named NAME. ``--stock-fp8`` adds ``sglang-fp8``, the earlier name of
``sglang-fp8_e4m3``.

    python -m bench.offline_loss --rho 0.7 0.5 0.3 --scorer snapkv --samples 12 --out results/offline-loss
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.accuracy_configs import (
    FULL,
    MIXED_SEP,
    PROFILE,
    STOCK,
    Config,
    config_bytes,
    mixed_formats,
    mixed_tiers,
    other_sources,
    plan_configs,
    profile_config,
    split_rotated,
    stock_configs,
)
from bench.accuracy_report import plot_kl
from bench.accuracy_stats import paired_diff
from sgl_ragged.stats import mean_se

if TYPE_CHECKING:
    import torch

SEED = 7  # calibration draws seed 0, BaKlaVa's search seed 1: these samples are held out


def selection_for(config: Config, shape: Any, page_size: int) -> tuple[Any, float]:
    """The compressed forward's selection for a configuration, and the KV bytes it keeps per
    token (fraction of a full bf16 cache: the server's layout of the budgets and precision;
    dynamic keeps rho of the entries)."""
    from sgl_ragged.emulator.compressed import (
        FlatTopSelection,
        SlotSelection,
        StockCache,
        TierSelection,
        head_slots,
        head_tiers,
    )
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.profile import resolve_profile
    from sgl_ragged.rotation import Rotation

    if config.kind == FULL:
        return None, 1.0
    if config.is_dynamic:
        return FlatTopSelection(config.rho), config.rho
    if config.kind == STOCK:
        return StockCache(config.precision), config_bytes(config, shape, page_size)
    base, rotated = split_rotated(config.precision)
    rotation = Rotation(shape.head_dim) if rotated else None
    if MIXED_SEP in base and config.kind != PROFILE:
        tiers, retention = mixed_tiers(config, shape, page_size)
        hi_fmt, lo_fmt = mixed_formats(base)
        groups = resolve_profile(config.profile, shape).groups
        return TierSelection(head_tiers(tiers, groups), lo_fmt, hi_fmt, rotation), retention
    profile = resolve_profile(config.profile, shape)
    layout = RaggedLayout.from_profile(profile, page_size, shape.head_dim, 2, base)
    if layout.quantized:  # per-head formats (mixed) where the profile has them
        formats = (None if layout.low_formats is None
                   else head_tiers(layout.low_formats, layout.groups))
        return TierSelection(head_tiers(layout.tiers, layout.groups), layout.low, layout.high,
                             rotation, formats), layout.retention
    return SlotSelection(head_slots(profile.budgets, profile.groups, page_size)), layout.retention


def evaluate(configs: list[Config], model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per configuration and sample: mean KL(full || config) and NLL over the scored tokens."""
    from sgl_ragged.emulator.chunks import ChunkingConfig
    from sgl_ragged.emulator.compressed import CompressedLoss, token_kl
    from sgl_ragged.emulator.runner import CaptureRunner
    from sgl_ragged.emulator.samples import build_samples
    from sgl_ragged.scoring import make_scorer

    runner = CaptureRunner(model)
    cfg = ChunkingConfig(args.page_size, args.chunk_size, args.obs_window)
    samples = build_samples(runner.tokenizer, args.samples, args.seed, args.min_tokens,
                            args.max_tokens, args.page_size)  # fmt: skip
    selections = {c.name: selection_for(c, runner.shape, args.page_size) for c in configs}
    losses = {name: CompressedLoss(runner, make_scorer(name), cfg) for name in {c.scorer for c in configs}}
    out: dict[str, Any] = {c.name: {"kl": [], "nll": [], "top1": [], "agree": [], "memory": selections[c.name][1]}
                           for c in configs}
    t0 = time.monotonic()
    for si, sample in enumerate(samples, start=1):
        full = losses[configs[0].scorer].log_probs(sample.input_ids, None)
        for c in configs:
            loss = losses[c.scorer]
            logp = full if c.kind == FULL else loss.log_probs(sample.input_ids, selections[c.name][0])
            out[c.name]["kl"].append(float(token_kl(full, logp).mean()))
            out[c.name]["nll"].append(float(loss.nll_of(logp, sample.input_ids).mean()))
            top1, agree = top1_rates(full, logp, sample.input_ids[cfg.chunk_size + 1 :])
            out[c.name]["top1"].append(top1)
            out[c.name]["agree"].append(agree)
        print(f"\rsample {si}/{len(samples)} ({len(configs)} configs, "
              f"{time.monotonic() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out["_meta"] = {"tokens": [int(s.num_tokens) for s in samples], "tasks": [s.task for s in samples],
                    "scored_tokens": sum(int(s.num_tokens) - cfg.chunk_size - 1 for s in samples)}
    return out


def top1_rates(full: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """full, logp [T, V] log-probabilities, targets [T] -> (fraction of tokens whose argmax is
    the next token, fraction whose argmax is the full cache's argmax)."""
    top = logp.argmax(-1)
    return (float((top == targets.to(top.device)).double().mean()),
            float((top == full.argmax(-1)).double().mean()))


def summarize(configs: list[Config], raw: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Mean ± SE over samples per configuration; paired differences vs uniform at the same rho
    (and vs static-mean for the other equal-memory sources)."""
    rows = []
    for c in configs:
        kl, nll = mean_se(raw[c.name]["kl"]), mean_se(raw[c.name]["nll"])
        rows.append({"name": c.name, "kind": c.kind, "rho": c.rho, "memory": raw[c.name]["memory"],
                     "kl": kl._asdict(), "nll": nll._asdict(),
                     "top1": mean_se(raw[c.name]["top1"])._asdict(),
                     "agree": mean_se(raw[c.name]["agree"])._asdict()})
    names = {c.name for c in configs}
    diffs = []
    for c in configs:
        others = [] if c.kind in (FULL, "tiers-all", STOCK) else [f"uniform@{c.rho}"]
        if c.kind in other_sources():
            others.append(f"static-mean-{c.scorer}@{c.rho}")
        others += _stock_rivals(c, configs, raw) + _unrotated_twin(c)
        for other in (o for o in others if o in names and o != c.name):  # not uniform@rho itself
            d = paired_diff(raw[c.name]["kl"], raw[other]["kl"])
            diffs.append({"a": c.name, "b": other, "rho": c.rho, "kl_mean": d.mean, "kl_se": d.se,
                          "kl_z": d.z})
    return rows, diffs


def _unrotated_twin(c: Config) -> list[str]:
    """A rotated tier configuration's unrotated twin ("int4r@0.3" -> "int4@0.3"), paired with it."""
    if c.kind in (FULL, STOCK) or not c.name.startswith(c.precision):
        return []
    base, rotated = split_rotated(c.precision)
    return [base + c.name[len(c.precision):]] if rotated else []


def _stock_rivals(c: Config, configs: list[Config], raw: dict[str, Any]) -> list[str]:
    """The SGLang caches a configuration is compared with: those that cost at least its bytes
    (within half a percent of a bf16 cache)."""
    if c.kind in (FULL, STOCK):
        return []
    mine = raw[c.name]["memory"]
    return [s.name for s in configs if s.kind == STOCK and mine <= raw[s.name]["memory"] + 0.005]


def markdown(rows: list[dict[str, Any]], diffs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"{meta['samples']} held-out samples (seed {meta['seed']}, {meta['scored_tokens']} scored "
             f"tokens after the first {meta['chunk_size']}-token chunk, page {meta['page_size']}); "
             "mean over samples ± standard error.", "",
             "| config | rho | KV bytes (vs bf16) | KL(full ‖ config) (nats/token) | NLL (nats/token) "
             "| top-1 (next token) | top-1 agreement with full |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['rho']} | {r['memory']:.3f} | {r['kl']['mean']:.4f} ± "
                     f"{r['kl']['se']:.4f} | {r['nll']['mean']:.4f} ± {r['nll']['se']:.4f} | "
                     f"{r['top1']['mean']:.4f} ± {r['top1']['se']:.4f} | "
                     f"{r['agree']['mean']:.4f} ± {r['agree']['se']:.4f} |")
    lines += ["", "Paired KL differences (a − b over the same samples):", "",
              "| rho | a | b | Δ KL | z |", "|---|---|---|---|---|"]
    for d in diffs:
        lines.append(f"| {d['rho']} | {d['a']} | {d['b']} | {d['kl_mean']:+.4f} ± {d['kl_se']:.4f} | "
                     f"{d['kl_z']:+.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rho", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    p.add_argument("--scorer", nargs="+", default=["snapkv"])
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="profiles as bench.accuracy finds them (default calib_profiles/<model>)")
    p.add_argument("--precision", nargs="*", default=[],
                   help="also row tiers at these low precisions (int8 int4 int2 fp8), as bench.accuracy; "
                        "a pair hi+lo (e.g. int8+int4) quantizes the high tier too: hi+lo@rho per rho")
    p.add_argument("--stock", nargs="*", default=[], metavar="DTYPE",
                   help="also SGLang's own quantized KV caches at their own bytes: sglang-<DTYPE> per "
                        "--kv-cache-dtype value (fp8_e4m3 mxfp8 fp4_mx_block16 nvfp4)")
    p.add_argument("--stock-fp8", action="store_true",
                   help="also sglang-fp8: the earlier name of SGLang's fp8_e4m3 cache (float8_e4m3fn, scale 1)")
    p.add_argument("--profile-config", nargs="*", default=[], metavar="NAME=PATH[=PRECISION]",
                   help="also these profile files as is, one configuration each (e.g. a per-head "
                        "precision profile of `sgl-ragged profile tiers`); PRECISION defaults to "
                        "the profile's own")
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=1536)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--obs-window", type=int, default=32)
    p.add_argument("--only", nargs="+", default=None, help="run only these config names (and full)")
    p.add_argument("--out", type=Path, default=Path("results/offline-loss"))
    return p.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from sgl_ragged.models.smollm2 import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    profile_dir = args.profile_dir or Path("calib_profiles") / Path(model).name.lower()
    from sgl_ragged.profile import model_shape

    head_dim = model_shape(model).head_dim
    configs, missing = plan_configs(args.rho, args.scorer, profile_dir, head_dim, args.precision,
                                    args.page_size)
    configs += stock_configs(args.stock, args.scorer[0])
    configs += [profile_config(spec, args.scorer[0], model_shape(model), args.page_size)
                for spec in args.profile_config]
    if args.stock_fp8:
        configs.append(Config("sglang-fp8", STOCK, 0.5, args.scorer[0], "uniform:1.0", "fp8_e4m3"))
    if args.only:
        configs = [c for c in configs if c.name in set(args.only) or c.kind == FULL]
    for path in missing:
        print(f"missing calibrated profile (skipped): {path}", flush=True)
    t0 = time.monotonic()
    raw = evaluate(configs, model, args)
    sample_meta = raw.pop("_meta")
    rows, diffs = summarize(configs, raw)
    meta = {"model": model, "samples": args.samples, "seed": args.seed, "page_size": args.page_size,
            "chunk_size": args.chunk_size, "obs_window": args.obs_window, **sample_meta,
            "wall_s": round(time.monotonic() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_loss.json").write_text(json.dumps(
        {"meta": meta, "configs": rows, "comparisons": diffs, "per_sample": raw}, indent=2))
    table = markdown(rows, diffs, meta)
    (args.out / "offline_loss.md").write_text(table)
    plot_kl(rows, args.out / "kl_vs_memory.png", "memory", "KV bytes per token (fraction of full bf16)",
            "Prefill compression, offline (held-out samples)")
    print(table)
    print(f"wrote {args.out}/offline_loss.json, offline_loss.md, kl_vs_memory.png ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
