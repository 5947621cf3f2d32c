"""Decode attention latency on non-uniform budgets: AOT split map vs uniform splits vs FlashInfer
with per-layer planning (TANGRAM sections 3.1.3 and 4.3), plus FlashInfer's planning share.

    python -m bench.decode_attention [--profile P.json] [--precision int4] --out results/decode_attention

Shapes: 32 layers x 8 KV heads x 128 head_dim, GQA 4, bfloat16, page size 64; every request
has `context` tokens in sealed pages and a ragged tail of staged tokens. One measurement = the
attention of one decode step over all layers (CUDA events, medians over repetitions after
warm-up). Achieved bandwidth = bytes of the rows read / time, beside a device-to-device copy.
With `--precision` (docs/architecture.md, "Row tiers") every case also runs rows with that low tier, composed
from the same budgets (tiers.compose: at most the drop-only bytes per page, so equal bytes up to
rounding; the split map gives their groups equal shares, registry.profile_split_ratios), beside the
drop-only rows. Writes decode_attention.json and decode_attention.md. Needs CUDA; exits 0
without it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from sgl_ragged.precision import FULL_PRECISION, PAIR_CHOICES, PRECISION_CHOICES

LAYERS, HEADS, HEAD_DIM, GQA, PAGE, TAIL = 32, 8, 128, 4, 64, 37


def synthetic_profile(heads_per_group: int, seed: int = 0):
    """Heterogeneous budgets (log-normal around 0.2, clipped to [0.03, 1]), clustered groups."""
    from sgl_ragged import budgets as bm
    from sgl_ragged.profile import BudgetProfile

    rng = random.Random(seed)
    budgets = [[min(1.0, max(0.03, math.exp(rng.gauss(math.log(0.2), 0.9)))) for _ in range(HEADS)]
               for _ in range(LAYERS)]
    groups = [bm.cluster_heads(layer, heads_per_group) for layer in budgets]
    return BudgetProfile(None, budgets, groups, {"kind": "uniform", "note": "synthetic"},
                         split_ratios=bm.split_ratios(budgets, groups))


def bench_profile(path: Path | None, heads_per_group: int):
    """(profile, its name): a calibrated profile of this benchmark's shapes, regrouped, or the
    synthetic one; exits with a message for a profile of other shapes."""
    from sgl_ragged.profile import BudgetProfile

    if path is None:
        return synthetic_profile(heads_per_group), "synthetic heterogeneous budgets"
    profile = BudgetProfile.load(path).regrouped(heads_per_group)
    if (profile.num_layers, profile.num_kv_heads) != (LAYERS, HEADS):
        sys.exit(f"{path.name} has {profile.num_layers} layers x {profile.num_kv_heads} KV heads; "
                 f"this benchmark's shapes are {LAYERS} x {HEADS}")
    return profile, path.name


def add_case_args(parser: argparse.ArgumentParser, batch: list[int] | None,
                  context: list[int] | None) -> None:
    """The options bench.decode_attention and bench.decode_breakdown share (scripts/gpu_check.sh
    passes its arguments to both)."""
    parser.add_argument("--profile", type=Path, default=None, help="a calibrated profile JSON "
                        f"({LAYERS} layers x {HEADS} KV heads); default: synthetic heterogeneous")
    parser.add_argument("--heads-per-group", type=int, default=2)
    parser.add_argument("--precision", choices=[*PRECISION_CHOICES, *PAIR_CHOICES], default=FULL_PRECISION,
                        help="also run rows with this low tier from the same budgets (equal "
                        "bytes), beside the drop-only rows")
    parser.add_argument("--batch", type=int, nargs="+", default=batch)
    parser.add_argument("--context", type=int, nargs="+", default=context)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--mem-fraction", type=float, default=0.6,
                        help="skip cases whose rows exceed this fraction of free GPU memory")


def build_case(profile, batch: int, context: int, precision: str = "bf16"):
    """Storage with random rows (and random low tiers), request plans and this step's q, k, v."""
    from sgl_ragged.attention_backend.plan import RequestPlan
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.mem_pool.storage import RaggedStorage
    from sgl_ragged.scoring import SnapKVScorer

    layout = RaggedLayout.from_profile(profile, PAGE, HEAD_DIM, 2, precision=precision)
    n = context // PAGE
    storage = RaggedStorage(layout, batch * n + 1, batch, torch.bfloat16, "cuda", SnapKVScorer())
    for t in [x for rows in (storage.rows_k, storage.rows_v) for layer in rows for x in layer]:
        t.normal_()
    for tier in (t for rows in (storage.low_rows, storage.high_rows) for layer in rows
                 for t in layer if t is not None):
        for codes in (tier.k_codes, tier.v_codes):  # fp8: no NaN codes (0x7f, 0xff)
            codes.copy_(torch.randint_like(codes, 256) & (0xF7 if tier.k_zero is None else 0xFF))
        for params in (tier.k_scale, tier.v_scale):
            params.uniform_(0.01, 0.1)
        for params in (tier.k_zero, tier.v_zero):
            if params is not None:
                params.normal_()
    for t in storage.stage_k + storage.stage_v:
        t.normal_()
    plans = [RequestPlan(
        q_start=b, prefix=n * PAGE + TAIL - 1, seq_len=n * PAGE + TAIL, tail_start=n * PAGE,
        sealed_pages=torch.arange(1 + b * n, 1 + (b + 1) * n, device="cuda"),
        prior_stages=torch.tensor([b], device="cuda"), tail_pages=torch.tensor([0]), num_seal=0,
        after_stages=torch.tensor([b], device="cuda"), tail_obs=torch.zeros(TAIL, device="cuda"),
        obs_queries=1) for b in range(batch)]
    qkv = (torch.randn(batch, HEADS * GQA, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
           torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
           torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
    return storage, plans, qkv


def timed(step, warmup: int, repeats: int) -> float:
    """Median seconds of step() (CUDA events; the host waits for each)."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 3, 10)


def bytes_read(storage, batch: int, context: int) -> int:
    rows = storage.layout.row_bytes_per_page * (context // PAGE) * batch
    tail = 2 * LAYERS * HEADS * HEAD_DIM * 2 * TAIL * batch
    return rows + tail


def measure(profile, batch: int, context: int, warmup: int, repeats: int,
            precision: str = "bf16", baseline: dict | None = None) -> dict:
    """Latency of one decode step's attention (all layers) for the three strategies (FlashInfer
    reads drop-only rows only); with `baseline` (bench.triton_baseline.load) also another
    revision's kernels on the same rows, split maps and N_CTA (`baseline_<strategy>_s`)."""
    from bench.flashinfer_decode import FlashInferPlannedDecode
    from sgl_ragged.attention_backend.registry import profile_split_ratios
    from sgl_ragged.kernels.aot import SplitStrategy, device_parallelism, split_plan
    from sgl_ragged.kernels.batch import kernel_batch
    from sgl_ragged.kernels.decode import decode_attention
    from sgl_ragged.kernels.tables import all_layer_tables

    storage, plans, (q, k, v) = build_case(profile, batch, context, precision)
    tables, batch_t = all_layer_tables(storage), kernel_batch(plans, "cuda")
    scale, ctas = HEAD_DIM**-0.5, device_parallelism("cuda")
    ratios = profile_split_ratios(storage, profile)
    outs, result = {}, {"batch": batch, "context": context, "num_ctas": ctas,
                        "precision": precision,
                        "row_bytes_per_page": storage.layout.row_bytes_per_page}
    for strategy in SplitStrategy:
        splits = split_plan(ratios, ctas, "cuda", strategy)

        def step(splits=splits):
            for layer in range(LAYERS):
                out = decode_attention(q, k, v, storage.stage_k[layer], storage.stage_v[layer],
                                       tables[layer], splits.layer(layer), batch_t, scale)
            return out

        outs[strategy.value] = step()[0]
        result[f"{strategy.value}_s"] = timed(step, warmup, repeats)
    if baseline is not None:
        base_tables = baseline["tables"].all_layer_tables(storage)
        base_batch = baseline["batch"].kernel_batch(plans, "cuda")
        for strategy in SplitStrategy:
            base_splits = baseline["aot"].split_plan(
                ratios, ctas, "cuda", baseline["aot"].SplitStrategy(strategy.value))

            def base_step(splits=base_splits):
                for layer in range(LAYERS):
                    out = baseline["decode"].decode_attention(
                        q, k, v, storage.stage_k[layer], storage.stage_v[layer],
                        base_tables[layer], splits.layer(layer), base_batch, scale)
                return out

            outs[f"baseline_{strategy.value}"] = base_step()[0]
            result[f"baseline_{strategy.value}_s"] = timed(base_step, warmup, repeats)
    if flashinfer_available() and not storage.layout.quantized:
        fi = FlashInferPlannedDecode(storage, tables, GQA)
        fi.set_batch(batch_t, [p.sealed_pages for p in plans])

        def fi_step():
            for layer in range(LAYERS):
                out = fi.layer(layer, q, k, v, scale)
            return out

        outs["flashinfer"] = fi_step()[0]
        result["flashinfer_s"] = timed(fi_step, warmup, repeats)
        fi.plan_seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(repeats):
            fi_step()
        torch.cuda.synchronize()
        result["flashinfer_plan_share"] = fi.plan_seconds / (time.perf_counter() - t0)
    result["max_abs_diff_vs_aot"] = {k: float((o.float() - outs["aot"].float()).abs().max())
                                     for k, o in outs.items()}
    result["bytes_read"] = bytes_read(storage, batch, context)
    for name in outs:
        result[f"{name}_gbps"] = result["bytes_read"] / result[f"{name}_s"] / 1e9
    return result


def flashinfer_available() -> bool:
    """FlashInfer is SGLang's dependency, absent where only torch and Triton are installed (the
    planned baseline is then left out of the table)."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def fits(profile, batch: int, context: int, cap_bytes: float, precision: str = "bf16") -> bool:
    from sgl_ragged.mem_pool.layout import RaggedLayout

    layout = RaggedLayout.from_profile(profile, PAGE, HEAD_DIM, 2, precision=precision)
    return layout.row_bytes_per_page * (context // PAGE) * batch <= cap_bytes


def markdown(results: list[dict], copy_gbps: float, profile_name: str) -> str:
    lines = [f"Decode attention, one step over {LAYERS} layers ({profile_name}); "
             f"device copy bandwidth {copy_gbps:.0f} GB/s.", "",
             "| batch | context | rows | KiB/page | AOT ms | uniform ms | FlashInfer ms "
             "| FI planning share | AOT GB/s | uniform GB/s | FI GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    based = [r for r in results if "baseline_aot_s" in r]
    if based:
        lines[0] += (" Baseline: another revision's kernels (bench.triton_baseline) on the same "
                     "rows, split maps and N_CTA; its table follows.")
    for r in results:
        rows = r.get("precision", "bf16")
        rows = "drop only" if rows == "bf16" else rows
        if r.get("skipped"):
            lines.append(f"| {r['batch']} | {r['context']} | {rows} | skipped: {r['skipped']} "
                         "|||||||")
            continue
        fi = ("| not installed | - " if "flashinfer_s" not in r else
              f"| {r['flashinfer_s'] * 1e3:.3f} | {r['flashinfer_plan_share']:.1%} ")
        if "flashinfer_s" not in r and r.get("precision", "bf16") != "bf16":
            fi = "| - | - "  # FlashInfer reads drop-only rows only
        lines.append(
            f"| {r['batch']} | {r['context']} | {rows} | {r['row_bytes_per_page'] / 1024:.1f} "
            f"| {r['aot_s'] * 1e3:.3f} | {r['uniform_s'] * 1e3:.3f} "
            + fi + f"| {r['aot_gbps']:.0f} | {r['uniform_gbps']:.0f} "
            + (f"| {r['flashinfer_gbps']:.0f} |" if "flashinfer_gbps" in r else "| - |"))
    if based:
        lines += ["", "| batch | context | rows | AOT ms | baseline AOT ms | AOT / baseline "
                  "| uniform ms | baseline uniform ms | uniform / baseline |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in based:
            rows = "drop only" if r.get("precision", "bf16") == "bf16" else r["precision"]
            cells = [f"{r[f'{s}_s'] * 1e3:.3f} | {r[f'baseline_{s}_s'] * 1e3:.3f} | "
                     f"x{r[f'{s}_s'] / r[f'baseline_{s}_s']:.2f}" for s in ("aot", "uniform")]
            lines.append(f"| {r['batch']} | {r['context']} | {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser, batch=[4, 16, 64], context=[8192, 32768, 65536])
    parser.add_argument("--out", type=Path, default=Path("results/decode_attention"))
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a directory from bench.triton_baseline: also time that "
                        "revision's kernels on the same rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_attention.py needs a CUDA device (Triton kernels, FlashInfer); "
              "nothing measured.")
        sys.exit(0)
    profile, name = bench_profile(args.profile, args.heads_per_group)
    baseline = None
    if args.baseline is not None:
        from bench.triton_baseline import load

        baseline = load(args.baseline)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth() / 1e9
    cap = torch.cuda.mem_get_info()[0] * args.mem_fraction
    precisions = list(dict.fromkeys([FULL_PRECISION, args.precision]))
    results = []
    for batch in args.batch:
        for context in args.context:
            for precision in precisions:
                if not fits(profile, batch, context, cap, precision):
                    results.append({"batch": batch, "context": context, "precision": precision,
                                    "skipped": "memory"})
                    continue
                print(f"batch {batch}, context {context}, {precision} ...", flush=True)
                results.append(measure(profile, batch, context, args.warmup, args.repeats,
                                       precision, baseline))
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"profile": name, "mean_budget": profile.mean_budget, "copy_gbps": copy_gbps,
               "device": torch.cuda.get_device_name(), "baseline": str(args.baseline or ""),
               "results": results}
    (args.out / "decode_attention.json").write_text(json.dumps(summary, indent=2))
    table = markdown(results, copy_gbps, name)
    (args.out / "decode_attention.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
