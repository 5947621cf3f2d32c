"""Accuracy of compressed KV caches on the same held-out multi-turn sessions: full KV, uniform
budgets, static calibrated budgets (TANGRAM, "w/") and the dynamic reference ("w/o") per scorer.

    nice -n 5 python -m bench.accuracy --sessions 12 --out results/accuracy

Every configuration is a `--attention-backend ragged` server ("full" is `uniform:1.0`, which drops
nothing, so all configurations share one code path); servers run one after another. Per session,
turn 1's context is sent alone first so its pages are sealed (compressed) and cached; then each
question is sent teacher-forced with its reference history and reference answer, with logprobs
over the answer tokens and the closing <|im_end|>. Two metrics per question:

- exact match: the top-1 token equals the reference at every answer position (what greedy
  decoding would need to reproduce the answer token for token and stop);
- mean KL(full || config) of the next-token distributions over those positions, over the full
  run's top-K tokens plus one bucket for the rest of the mass (a lower bound of the true KL).

`--stock DTYPE` adds stock SGLang servers (no plugin) with SGLang's own `--kv-cache-dtype DTYPE`
cache, configuration sglang-<DTYPE>: `auto` (stock's cache in the model's dtype, on torch_native,
which measures the two backends' own difference from full), fp8_e4m3 on intel_amx, the one CPU
backend SGLang 0.5.23 stores it for (it needs sgl-kernel's CPU build, which PyPI's wheel lacks:
such a server stops at startup here).

Writes raw/<config>.json (per question), accuracy.json, accuracy.md and kl_vs_rho.png. `--resume`
skips configurations whose raw file matches the workload; `--base-url` evaluates one running
server as `--config NAME` (the reference `full` first). `--profile-config NAME=PATH[=PRECISION]`
adds a profile file as is (e.g. per-head precision from `sgl-ragged profile tiers`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.accuracy_client import SessionPlan, evaluate, plan_session
from bench.accuracy_configs import (
    FULL,
    MIXED_SEP,
    STOCK,
    Config,
    config_bytes,
    plan_configs,
    profile_config,
    split_rotated,
    stock_configs,
)
from bench.accuracy_report import markdown, plot
from bench.accuracy_scoring import SCORED_TASKS, comparisons, summarize
from bench.tokens import local_counter
from bench.workloads import WorkloadConfig, build_sessions


def server_args(model: str, args: argparse.Namespace) -> list[str]:
    return ["--model-path", model, "--device", "cpu", "--dtype", args.dtype,
            "--max-total-tokens", str(args.max_total_tokens), "--page-size", "64",
            "--chunked-prefill-size", "256"]


def run_one(config: Config, model: str, args: argparse.Namespace, plans: list[SessionPlan],
            ref: dict[tuple[int, int], dict[str, Any]] | None) -> tuple[list[dict[str, Any]], float]:
    """Evaluate one configuration on --base-url or on a fresh server; returns records and the
    server's startup seconds."""
    if args.base_url:
        return evaluate(args.base_url, plans, args.top_k, ref, config.name), 0.0
    from sgl_ragged.testing.server import ServerProcess

    log = args.out / "logs" / f"{config.name}.log"
    attention = ([] if args.ragged_attention is None or config.kind == STOCK
                 else ["--ragged-attention", args.ragged_attention])
    with ServerProcess([*server_args(model, args), *config.server_args(), *attention],
                       log_path=log) as server:
        print(f"    server up in {server.startup_seconds:.0f} s (log {log})", flush=True)
        return evaluate(server.base_url, plans, args.top_k, ref, config.name), server.startup_seconds or 0.0


def planned(args: argparse.Namespace, profile_dir: Path, shape: Any) -> tuple[list[Config], list[str]]:
    """plan_configs' configurations, then the --profile-config ones; and the missing profiles."""
    configs, missing = plan_configs(args.rho, args.scorer, profile_dir, shape.head_dim, args.precision)
    configs += [profile_config(spec, args.scorer[0], shape) for spec in args.profile_config]
    return configs + stock_configs(args.stock, args.scorer[0], served=True), missing


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rho", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    p.add_argument("--scorer", nargs="+", default=["snapkv", "expected_attention"])
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="calibrated profiles <scorer>-rho<rho>.json (default calib_profiles/<model>)")
    p.add_argument("--precision", nargs="*", default=[],
                   help="also row tiers at these low precisions (int8 int4 int2 fp8): p@rho per rho "
                        f"and p-all (every token at p); a pair such as int8{MIXED_SEP}int4 (a "
                        "quantized high tier): p@rho per rho")
    p.add_argument("--profile-config", nargs="*", default=[], metavar="NAME=PATH[=PRECISION]",
                   help="also these profile files as is, one configuration each (e.g. a per-head "
                        "precision profile of `sgl-ragged profile tiers`); PRECISION defaults to "
                        "the profile's own")
    p.add_argument("--stock", nargs="*", default=[], metavar="DTYPE",
                   help="also stock SGLang servers (its CPU attention backend, no ragged plugin) "
                        "with these --kv-cache-dtype values, one configuration sglang-<DTYPE> "
                        "each: fp8_e4m3 (SGLang 0.5.23 serves it on a CPU only on its intel_amx "
                        "backend: AMX and sgl-kernel's CPU build, not PyPI's wheel), or auto "
                        "(the model's dtype: the two backends' own difference from full)")
    p.add_argument("--ragged-attention", default=None,
                   help="--ragged-attention of every ragged server (default: the server's auto)")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--only", nargs="+", default=None, help="run only these config names")
    p.add_argument("--base-url", default=None, help="evaluate this running server as --config")
    p.add_argument("--config", default=None, help="the config name of --base-url's server")
    p.add_argument("--resume", action="store_true", help="skip configs whose raw file matches")
    p.add_argument("--deadline-min", type=float, default=None,
                   help="start no further config after this many minutes (the report covers the done ones)")
    p.add_argument("--out", type=Path, default=Path("results/accuracy"))
    args = p.parse_args()
    if args.base_url and not args.config:
        p.error("--base-url needs --config NAME (full first: the others need its top-K)")
    return args


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from sgl_ragged.models.smollm2 import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    profile_dir = args.profile_dir or Path("calib_profiles") / Path(model).name.lower()
    from sgl_ragged.precision import tier_precision

    for pair in (p for p in args.precision if MIXED_SEP in p):
        try:  # the pairs a server stores (bench.offline_loss has more), rotated or not
            tier_precision(split_rotated(pair)[0])
        except ValueError as e:
            raise SystemExit(f"--precision {pair}: {e}") from None
    from sgl_ragged.profile import model_shape

    shape = model_shape(model)
    configs, missing = planned(args, profile_dir, shape)
    if args.base_url or args.only:
        wanted = {args.config} if args.base_url else set(args.only)
        configs = [c for c in configs if c.name in wanted or (c.name == FULL and not args.base_url)]
    for path in missing:
        print(f"missing calibrated profile (skipped): {path}", flush=True)

    wl = WorkloadConfig(sessions=args.sessions, turns=args.turns, context_tokens=args.context_tokens,
                        tasks=SCORED_TASKS, seed=args.seed)
    tok = AutoTokenizer.from_pretrained(model)
    plans = [plan_session(tok, s) for s in build_sessions(wl, local_counter(model))]
    meta = {"model": model, "sessions": wl.sessions, "turns": wl.turns, "tasks": list(wl.tasks),
            "context_tokens": wl.context_tokens, "seed": wl.seed, "top_k": args.top_k,
            "dtype": args.dtype, "questions": sum(len(p.questions) for p in plans),
            "prime_tokens_mean": sum(len(p.prime_ids) for p in plans) / len(plans)}
    raw_dir = args.out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    print(f"{meta['questions']} questions, contexts ~{meta['prime_tokens_mean']:.0f} tokens, "
          f"{len(configs)} configs", flush=True)

    t_start, records, timings = time.monotonic(), {}, {}
    for i, config in enumerate(configs, start=1):
        raw = raw_dir / f"{config.name}.json"
        if (args.resume or args.base_url) and raw.is_file():
            saved = json.loads(raw.read_text())
            if saved["meta"] == meta and (args.resume or config.name != args.config):
                records[config.name] = saved["records"]
                if "timing" in saved:
                    timings[config.name] = saved["timing"]
                print(f"[{i}/{len(configs)}] {config.name}: kept {raw}", flush=True)
                continue
        if args.deadline_min is not None and time.monotonic() - t_start > 60 * args.deadline_min:
            print(f"[{i}/{len(configs)}] {config.name}: skipped, past --deadline-min", flush=True)
            continue
        ref = None
        if config.name != FULL:
            ref_path = raw_dir / f"{FULL}.json"
            if FULL not in records and ref_path.is_file():
                records[FULL] = json.loads(ref_path.read_text())["records"]
            ref = {(r["session"], r["turn"]): r for r in records[FULL]}
        flags = (f"stock SGLang, --kv-cache-dtype {config.precision}" if config.kind == STOCK
                 else f"--ragged-profile {config.profile} --ragged-scorer {config.scorer} "
                      f"--ragged-precision {config.precision}")
        print(f"[{i}/{len(configs)}] {config.name} ({flags}), "
              f"{time.monotonic() - t_start:.0f} s elapsed", flush=True)
        t0 = time.monotonic()
        recs, startup = run_one(config, model, args, plans, ref)
        timings[config.name] = {"startup_s": startup, "eval_s": time.monotonic() - t0 - startup}
        records[config.name] = recs
        raw.write_text(json.dumps({"meta": meta, "config": asdict(config),
                                   "timing": timings[config.name], "records": recs}))

    done = [c for c in planned(args, profile_dir, shape)[0] if c.name in records]
    summaries = [summarize(c, records[c.name], config_bytes(c, shape)) for c in done]
    comps = comparisons(done, records)
    result = {"meta": meta, "missing_profiles": missing, "timings": timings,
              "wall_s": time.monotonic() - t_start, "configs": summaries, "comparisons": comps}
    (args.out / "accuracy.json").write_text(json.dumps(result, indent=2))
    table = markdown(summaries, comps, meta)
    (args.out / "accuracy.md").write_text(table)
    plot(summaries, args.out / "kl_vs_rho.png")
    print(table)
    print(f"wrote {args.out}/accuracy.json, accuracy.md, kl_vs_rho.png "
          f"({time.monotonic() - t_start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
