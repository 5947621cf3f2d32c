"""CPU attention of the ragged backend: batched torch vs the per-request torch reference,
side by side on the same storage and batch (or, with --native, the native kernels vs batched).

    python -m bench.cpu_attention [--profile P.json] --out results/cpu_attention
    python -m bench.cpu_attention --precision int4 --out results/cpu_attention_int4
    python -m bench.cpu_attention --native bf16 int4 --out results/cpu_attention_native
    python -m bench.cpu_attention --native bf16 int4 --prefill-batch --baseline OLD.so ...

With --native, each case is built once per listed precision (rows of the same profile, so the
same bytes per page) and batched torch and the native kernels (cuda_ext/; prefill chunks too,
which the server may send to batched torch: native_impl.prefill_on_batched) run on every
precision's storage alternately, one forward each per round, so both ratios (batched / native,
and native / the first precision's native) compare runs of the same rounds; --baseline adds
another build of the kernels (`python -m bench.native_baseline --rev R`) to the same rounds,
for before/after figures of a kernel change, and --no-batched leaves batched torch out.
--cached-rows adds the native kernels on the same batch with every request's sealed pages
pointed at its first one (the same work, its rows in cache), in the same rounds: 1 - cached /
native is the share of the step spent waiting on memory.

With --precision, the comparison is instead batched attention over drop-only rows vs rows with
a low-precision tier (docs/architecture.md, "Row tiers") of the same profile: the same KV bytes per page,
spent on more tokens (ratio = tiered / drop-only time).

One measurement = what the backend does for one forward: `prepare` (per-forward tables) plus
every layer's attention, staging and (for prefill) sealing -- the model's matmuls excluded.
Shapes from the profile's model (default: SmolLM2-135M-Instruct's calibrated SnapKV rho 0.3:
30 layers x 3 KV heads x 64 head_dim, GQA 3; `--gqa G` and `--head-dim D` time other shapes of
the same layers and budgets, e.g. a decode step at GQA 8, head_dim 128, as Llama-3-70B's),
bfloat16, page size 64. Decode: every request has
`context` tokens in sealed pages and a tail of 37 staged tokens, plus its new token. Prefill:
one 256-token chunk per request after `context` sealed tokens, sealing its complete pages but
the last. Medians over repetitions after warm-up (wall clock); ratio = reference / batched.
Writes cpu_attention.json and cpu_attention.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from bench.cpu_sweep import round_order
from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention
from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.native_impl import NativeAttention
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import BudgetProfile
from sgl_ragged.profile.source import ModelFreeKind
from sgl_ragged.profile.spec import model_free_kind, parse_uniform_spec, uniform_profile
from sgl_ragged.scoring import SnapKVScorer

PAGE, TAIL, CHUNK, GQA = 64, 37, 256, 3
REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = Path("calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json")


def build_case(profile: BudgetProfile, batch: int, context: int, decode: bool,
               precision: str = "bf16", gqa: int = GQA,
               ) -> tuple[RaggedStorage, list[RequestPlan], tuple[torch.Tensor, ...]]:
    """Storage with random rows and staging pages, the batch's plans and its q, k, v (`gqa`
    query heads per KV head)."""
    model = profile.model
    layout = RaggedLayout.from_profile(profile, PAGE, model.head_dim, 2, precision)
    n, new = context // PAGE, 1 if decode else CHUNK
    tail_pages = -(-(TAIL + new) // PAGE) if decode else CHUNK // PAGE
    storage = RaggedStorage(layout, batch * (n + tail_pages) + 1, batch * tail_pages,
                            torch.bfloat16, "cpu", SnapKVScorer())
    for t in [x for rows in (storage.rows_k, storage.rows_v) for layer in rows for x in layer]:
        t.normal_()
    for t in storage.stage_k + storage.stage_v:
        t.normal_()
    for layer, tiers in enumerate(storage.low_rows):
        for g, tier in enumerate(tiers):
            if tier is not None:  # every page's low tier from random K/V, through the quantizer
                pages = torch.arange(storage.num_pages)
                shape = (storage.num_pages, *tier.k_codes.shape[1:3], model.head_dim)
                storage.write_low(layer, g, pages, torch.randn(shape), torch.randn(shape))
    plans = [_plan(b, n, tail_pages, decode) for b in range(batch)]
    H, D = model.num_kv_heads, model.head_dim
    qkv = tuple(torch.randn(batch * new, h, D, dtype=torch.bfloat16) for h in (H * gqa, H, H))
    return storage, plans, qkv


def _plan(b: int, n: int, tail_pages: int, decode: bool) -> RequestPlan:
    """Request b: n sealed pages, then (decode) TAIL staged tokens + 1 or (prefill) a chunk."""
    first = 1 + b * (n + tail_pages)
    staged, new = (TAIL, 1) if decode else (0, CHUNK)
    stages = torch.arange(b * tail_pages, (b + 1) * tail_pages)
    num_seal = 0 if decode else tail_pages - 1
    return RequestPlan(
        q_start=b * new, prefix=n * PAGE + staged, seq_len=n * PAGE + staged + new,
        tail_start=n * PAGE, sealed_pages=torch.arange(first, first + n),
        prior_stages=stages[: -(-staged // PAGE)], tail_pages=torch.arange(first + n, first + n + tail_pages),
        num_seal=num_seal, after_stages=stages[num_seal:], tail_obs=torch.ones(staged + new),
        obs_queries=min(32, new))


def timed(step, warmup: int, repeats: int) -> float:
    """Median wall-clock seconds of step()."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def timed_alternating(steps: dict[str, object], warmup: int, repeats: int) -> dict[str, float]:
    """Median wall-clock seconds of each step, run in turn every round (shared-machine noise
    hits all of them alike; the order reversed every other round)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(repeats):
        for name, step in round_order(steps.items(), round_):
            t0 = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def forward_step(impl: AttentionImpl, plans: list[RequestPlan], qkv: tuple, scale: float,
                 decode: bool, num_layers: int):
    """One measured forward: `prepare` plus every layer's attention, staging and sealing;
    returns the last layer's output."""

    def step() -> torch.Tensor:
        prepared = impl.prepare(BatchPlan(requests=plans))
        for layer in range(num_layers):
            out = impl.forward(layer, prepared, *qkv, scale, decode)
        return out

    return step


def cached_plans(plans: list[RequestPlan]) -> list[RequestPlan]:
    """The same batch with each request's sealed pages all its first one: the same work on rows
    that stay in cache (what a step waits on memory is the difference)."""
    return [dataclasses.replace(p, sealed_pages=p.sealed_pages[:1].expand_as(p.sealed_pages))
            for p in plans]


def measure_native(profile: BudgetProfile, batch: int, context: int, decode: bool,
                   precisions: list[str], warmup: int, repeats: int,
                   baseline: ModuleType | None = None, batched: bool = True,
                   cached: bool = False, gqa: int = GQA) -> list[dict]:
    """Batched torch vs the native kernels on one batch, on a storage of each precision,
    every (precision, implementation) pair timed in the same alternating rounds, so the
    ratios between precisions (int4 / drop) see the same machine state (`baseline`: another
    build of the kernels, timed alongside as "baseline"; `batched` False: the native kernels
    alone, or against the baseline; `cached`: the native kernels on cached_plans too, as
    "cached")."""
    scale = profile.model.head_dim**-0.5
    results, steps, outs = [], {}, {}
    for precision in precisions:
        storage, plans, (q, k, v) = build_case(profile, batch, context, decode, precision, gqa)
        results.append({"phase": "decode" if decode else "prefill", "batch": batch,
                        "context": context, "precision": precision,
                        "bytes_per_page": storage.layout.row_bytes_per_page})
        impls = [("batched", BatchedTorchAttention(storage))] if batched else []
        impls.append(("native", NativeAttention(storage, extend_on_batched=False)))
        module = baseline_module(baseline, storage)
        if module is not None:
            impls.append(("baseline", NativeAttention(storage, module=module,
                                                      extend_on_batched=False)))
        for name, impl in impls:
            step = forward_step(impl, plans, (q, k, v), scale, decode, profile.num_layers)
            outs[precision, name] = step()
            steps[precision, name] = step
            if cached and name == "native":
                steps[precision, "cached"] = forward_step(impl, cached_plans(plans), (q, k, v),
                                                          scale, decode, profile.num_layers)
    seconds = timed_alternating(steps, warmup, repeats)
    for result in results:
        precision = result["precision"]
        for (p, name), s in seconds.items():
            if p == precision:
                result[f"{name}_s"] = s
        if batched:
            result["speedup"] = result["batched_s"] / result["native_s"]
        other = "batched" if batched else "baseline" if "baseline_s" in result else None
        if other:
            result["max_abs_diff"] = float((outs[precision, "native"].float()
                                            - outs[precision, other].float()).abs().max())
    return results


def baseline_module(baseline: ModuleType | None, storage: RaggedStorage) -> object | None:
    """`baseline` as NativeAttention's module on `storage`: as it is where its `attend` takes
    per-group formats, behind _SharedFormat where it predates them (None where it cannot read
    the storage: a high tier)."""
    if baseline is None:
        return None
    if "arg6: torch.Tensor" not in baseline.attend.__doc__:  # arg6: the high tiers, a list
        return baseline
    return _SharedFormat(baseline) if storage.layout.high is None else None


class _SharedFormat:
    """A build from before per-group formats (one low format for all groups, no high tier:
    `attend(..., low, head_map, ..., bits, is_float, scale, serial_pairs)`) behind today's
    signature; its other functions as they are."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def __getattr__(self, name: str) -> object:
        return getattr(self.module, name)

    def attend(self, q, k_pages, v_pages, rows_k, rows_v, low, high, formats, head_map, requests,
               sealed_off, sealed_pages, scale, serial_pairs):
        assert not any(t.numel() for t in high), "the baseline build reads no high tier"
        bits, is_float = int(formats[:, 0].max()), bool(formats[:, 1].max())
        return self.module.attend(q, k_pages, v_pages, rows_k, rows_v, low, head_map, requests,
                                  sealed_off, sealed_pages, bits, is_float, scale, serial_pairs)


def load_baseline(path: Path) -> ModuleType:
    """A shared object of another build of the native kernels, its module named as the file
    (`python -m bench.native_baseline --rev R` builds one with its own extension name and C++
    namespace: two builds with the same symbols in one process bind to one of them)."""
    import importlib.machinery
    import importlib.util

    from sgl_ragged.native import NAME

    name = path.name.split(".")[0]
    if name == NAME:
        raise SystemExit(f"--baseline {path}: a build named {NAME} shares its C++ symbols with "
                         "the current kernels, so both would run the same code; build the "
                         "baseline with `python -m bench.native_baseline --rev <rev>`")
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def markdown_native(results: list[dict], profile_name: str) -> str:
    """One row per case; with a baseline build its time and baseline / native too, and for
    each case the native time relative to the first precision's (e.g. int4 / drop)."""
    base, cached = "baseline_s" in results[0], "cached_s" in results[0]
    lines = [f"Ragged attention per forward on the CPU, batched torch vs native kernels "
             f"({profile_name}; {torch.get_num_threads()} threads; alternating), medians.", "",
             "| phase | batch | context | rows | bytes/page | batched ms | native ms | "
             "batched / native | native / first rows |"
             + (" baseline ms | baseline / native |" if base else "")
             + (" cached rows ms | memory share |" if cached else "") + " max abs diff |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if base else "")
             + ("---|---|" if cached else "")]
    first: dict[tuple, float] = {}
    for r in results:
        key = (r["phase"], r["batch"], r["context"])
        first.setdefault(key, r["native_s"])
        batched = (f"{r['batched_s'] * 1e3:.1f}", f"x{r['speedup']:.2f}") if "batched_s" in r \
            else ("-", "-")
        line = (f"| {r['phase']} | {r['batch']} | {r['context']} | {r['precision']} | "
                f"{r['bytes_per_page']} | {batched[0]} | {r['native_s'] * 1e3:.1f} | "
                f"{batched[1]} | x{r['native_s'] / first[key]:.2f} |")
        if base and "baseline_s" in r:
            line += f" {r['baseline_s'] * 1e3:.1f} | x{r['baseline_s'] / r['native_s']:.2f} |"
        elif base:
            line += " - | - |"
        if cached:
            line += f" {r['cached_s'] * 1e3:.1f} | {1 - r['cached_s'] / r['native_s']:.0%} |"
        lines.append(line + (f" {r['max_abs_diff']:.1e} |" if "max_abs_diff" in r else " - |"))
    return "\n".join(lines) + "\n"


def measure(profile: BudgetProfile, batch: int, context: int, decode: bool, warmup: int,
            repeats: int, gqa: int = GQA) -> dict:
    storage, plans, (q, k, v) = build_case(profile, batch, context, decode, gqa=gqa)
    scale = profile.model.head_dim**-0.5
    result = {"phase": "decode" if decode else "prefill", "batch": batch, "context": context}
    outs = {}
    for name, impl in (("reference", TorchAttention(storage)),
                       ("batched", BatchedTorchAttention(storage))):
        step = forward_step(impl, plans, (q, k, v), scale, decode, profile.num_layers)
        outs[name] = step()
        result[f"{name}_s"] = timed(step, warmup, repeats)
    result["speedup"] = result["reference_s"] / result["batched_s"]
    result["max_abs_diff"] = float((outs["batched"].float() - outs["reference"].float()).abs().max())
    return result


def measure_precision(profile: BudgetProfile, batch: int, context: int, decode: bool,
                      precision: str, warmup: int, repeats: int, gqa: int = GQA) -> dict:
    """Batched attention over drop-only rows and over tiered rows of the same byte budget."""
    scale = profile.model.head_dim**-0.5
    result = {"phase": "decode" if decode else "prefill", "batch": batch, "context": context}
    for name in ("bf16", precision):
        storage, plans, (q, k, v) = build_case(profile, batch, context, decode, name, gqa)
        step = forward_step(BatchedTorchAttention(storage), plans, (q, k, v), scale, decode,
                            profile.num_layers)
        result[f"{name}_s"] = timed(step, warmup, repeats)
        result[f"{name}_tokens_per_page"] = sum(sum(layer) for layer in storage.layout.slots) / sum(
            len(layer) for layer in storage.layout.slots)
        result[f"{name}_bytes_per_page"] = storage.layout.row_bytes_per_page
    result["ratio"] = result[f"{precision}_s"] / result["bf16_s"]
    return result


def markdown_precision(results: list[dict], profile_name: str, precision: str) -> str:
    r0 = results[0]
    lines = [f"Batched CPU attention per forward, drop-only rows vs {precision} tiers at the same "
             f"bytes ({profile_name}: {r0['bf16_bytes_per_page']} vs {r0[f'{precision}_bytes_per_page']} "
             f"bytes per page; {r0['bf16_tokens_per_page']:.1f} vs {r0[f'{precision}_tokens_per_page']:.1f} "
             f"tokens kept per page and group; {torch.get_num_threads()} threads), medians.", "",
             f"| phase | batch | context | drop ms | {precision} ms | {precision} / drop |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['phase']} | {r['batch']} | {r['context']} | {r['bf16_s'] * 1e3:.1f} | "
                     f"{r[f'{precision}_s'] * 1e3:.1f} | x{r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict], profile_name: str) -> str:
    lines = [f"Ragged attention per forward on the CPU ({profile_name}; {torch.get_num_threads()} "
             "threads), medians.", "",
             "| phase | batch | context | reference ms | batched ms | speedup | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['phase']} | {r['batch']} | {r['context']} | {r['reference_s'] * 1e3:.1f} "
                     f"| {r['batched_s'] * 1e3:.1f} | x{r['speedup']:.2f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def load_profile(spec: str, head_dim: int | None = None) -> BudgetProfile:
    """A profile file, or `uniform:<ratio>` for the model of DEFAULT_PROFILE (a uniform profile
    fits any model; this one takes that model's shape, which the cases are built from);
    `head_dim` replaces its model's head size (budgets are per head, whatever its size)."""
    if model_free_kind(spec) is not ModelFreeKind.UNIFORM:
        profile = BudgetProfile.load(spec)
    else:
        model = BudgetProfile.load(REPO / DEFAULT_PROFILE).model
        uniform = uniform_profile(parse_uniform_spec(spec), model.num_layers, model.num_kv_heads)
        profile = dataclasses.replace(uniform, model=model)
    if head_dim is None or profile.model is None:
        return profile
    return dataclasses.replace(profile, model=dataclasses.replace(profile.model, head_dim=head_dim))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE),
                        help="a profile file (its model gives the shapes), or uniform:<ratio> "
                             "on the default profile's model (SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32],
                        help="decode batch sizes (none: prefill only)")
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--prefill-batch", type=int, nargs="*", default=[1, 4],
                        help="prefill batch sizes (none: decode only)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--precision", default=None,
                        help="compare drop-only rows with rows of this low precision instead")
    parser.add_argument("--native", nargs="+", default=None, metavar="PRECISION",
                        help="compare the native kernels with batched torch, rows of each of "
                             "these precisions (bf16 = drop-only)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="SO",
                        help="with --native: another build's sgl_ragged_native*.so, timed "
                             "alongside (before/after a kernel change; a build from before "
                             "per-group formats, rows without a quantized high tier)")
    parser.add_argument("--no-batched", dest="batched", action="store_false",
                        help="with --native: leave out the batched torch column (its forwards "
                             "take most of a run; for comparing native builds with --baseline)")
    parser.add_argument("--cached-rows", action="store_true",
                        help="with --native: time the native kernels also with every request's "
                             "sealed pages pointed at its first one (the same work on rows in "
                             "cache): the memory share column is the step's wait on memory")
    parser.add_argument("--gqa", type=int, default=GQA,
                        help=f"query heads per KV head (default {GQA}, the default model's)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="head size in place of the profile model's (64 for the default model)")
    parser.add_argument("--out", type=Path, default=Path("results/cpu_attention"))
    args = parser.parse_args()
    if args.gqa < 1:
        parser.error(f"--gqa {args.gqa}: give at least 1 query head per KV head")
    if args.head_dim is not None and (args.head_dim < 16 or args.head_dim % 16):
        parser.error(f"--head-dim {args.head_dim}: give a multiple of 16 (64 and 128 are the "
                     "common sizes)")
    if not args.batched and not args.native:
        parser.error("--no-batched needs --native (it drops the batched column of that table)")
    if args.cached_rows and not args.native:
        parser.error("--cached-rows needs --native (it times the native kernels on cached rows)")
    profile = load_profile(args.profile, args.head_dim)
    if profile.model is None:
        parser.error(f"{args.profile} names no model; the shapes come from its model")
    torch.manual_seed(0)
    baseline = load_baseline(args.baseline) if args.baseline else None
    cases = [(b, c, True) for b in args.batch for c in args.context]
    cases += [(b, c, False) for b in args.prefill_batch for c in args.context]
    results = []
    for i, (batch, context, decode) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {'decode' if decode else 'prefill'} batch {batch}, "
              f"context {context} ...", flush=True)
        if args.native:
            results += measure_native(profile, batch, context, decode, args.native, args.warmup,
                                      args.repeats, baseline, args.batched, args.cached_rows,
                                      args.gqa)
        elif args.precision:
            results.append(measure_precision(profile, batch, context, decode, args.precision,
                                             args.warmup, args.repeats, args.gqa))
        else:
            results.append(measure(profile, batch, context, decode, args.warmup, args.repeats,
                                   args.gqa))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"profile": str(args.profile), "mean_budget": profile.mean_budget,
               "gqa": args.gqa, "head_dim": profile.model.head_dim,
               "precision": args.precision, "native": args.native, "threads": torch.get_num_threads(), "results": results}
    (args.out / "cpu_attention.json").write_text(json.dumps(summary, indent=2))
    name = f"{Path(args.profile).name}, GQA {args.gqa}, head_dim {profile.model.head_dim}"
    if args.native:
        table = markdown_native(results, name)
    elif args.precision:
        table = markdown_precision(results, name, args.precision)
    else:
        table = markdown(results, name)
    (args.out / "cpu_attention.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
