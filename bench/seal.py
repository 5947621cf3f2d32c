"""Sealing on the CPU: what one seal of N full pages costs in every layer, per step.

    python -m bench.seal [--profile P.json] --precision bf16 int4 [--pages 4] --out results/seal
    python -m bench.seal --precision mixed --profile calib_profiles/.../mixed-uniform-rho0.3.json

A seal is what a prefill chunk (or a decode step whose window moves) does to the full pages
leaving its window, layer by layer (RaggedStorage.seal): the staging statistics of the pages
(`page_stats`), the sealer's selection of the tokens each KV head keeps (`select`), then the
row writer (`write_sealed`: per group the kept tokens gathered, the quantized tiers through
the quantizer, every tier written at the pages). Each step is timed apart, summed over the
layers, as the server runs it (one intra-op thread, `ops.intra_op_threads`); every precision of
the profile is timed in the same alternating rounds, with each row writer the storage has here
(`--writers`: `native`, cuda_ext/seal.cpp's one call a layer, what a CPU server runs where the
kernels are built, and `torch`, the per-group torch ops). `--index-heads` adds the torch writer
with each group's KV heads taken through an index tensor (a copy) instead of a slice where they
are adjacent (a view): the difference session 16 measured. Medians over repetitions after
warm-up; writes seal.json and seal.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench import cpu_sweep
from bench.cpu_attention import CHUNK, DEFAULT_PROFILE, PAGE, build_case
from sgl_ragged import native
from sgl_ragged.attention_backend import ops
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import BudgetProfile

STEPS = ("stats", "select", "write")
WRITERS = ("native", "torch")  # RaggedStorage.native_rows True / False


def seal_steps(storage: RaggedStorage, num_pages: int) -> dict[str, float]:
    """Seconds of each step of one seal of `num_pages` staged pages in every layer (the rows
    are rewritten at the same pages every time)."""
    stages = torch.arange(num_pages)
    pages = torch.arange(1, 1 + num_pages)
    page_start = torch.arange(num_pages) * storage.layout.page_size
    seconds = dict.fromkeys(STEPS, 0.0)
    for layer in range(storage.layout.num_layers):
        keys = storage.stage_k[layer].index_select(0, stages)
        values = storage.stage_v[layer].index_select(0, stages)
        t0 = time.perf_counter()
        stats = storage.stats.page_stats(layer, stages, keys, values, storage.scale)
        t1 = time.perf_counter()
        selection = storage.sealer.select(stats, page_start)
        t2 = time.perf_counter()
        storage.write_sealed(layer, pages, stats.keys, stats.values, selection)
        t3 = time.perf_counter()
        for step, dt in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            seconds[step] += dt
    return seconds


def measure(profile: BudgetProfile, precisions: list[str], num_pages: int, warmup: int,
            repeats: int, index_heads: bool = False,
            writers: tuple[str, ...] = WRITERS) -> list[dict]:
    """Median seconds per step of each precision's seal with each row writer (and with
    `index_heads`, of the torch writer on index tensors too), all in the same alternating
    rounds."""
    # (precision, writer, heads, storage, the head_span the torch writer indexes with)
    variants: list[tuple[str, str, str, RaggedStorage, list]] = []
    batch = -(-num_pages // (CHUNK // PAGE))  # prefill cases stage CHUNK / PAGE pages a request
    for precision in precisions:
        storage, _, _ = build_case(profile, batch, 1024, False, precision)
        if "native" in writers and not storage.native_rows:
            raise RuntimeError(f"the native row writer is not built here ({native.reason()}); "
                               "run scripts/env.sh, or pass --writers torch")
        for writer in writers:
            variants.append((precision, writer, "slices", storage, storage.head_span))
        if index_heads:
            variants.append((precision, "torch", "indices", storage, storage.head_index))
    samples: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(variants))}
    with ops.intra_op_threads(1):
        for round_ in range(warmup + repeats):
            for i, (_, writer, _, storage, spans) in cpu_sweep.round_order(enumerate(variants),
                                                                           round_):
                storage.head_span = spans
                storage.native_rows = writer == "native"
                seconds = seal_steps(storage, num_pages)
                if round_ >= warmup:
                    samples[i].append(seconds)
    for _, _, heads, storage, spans in variants:
        if heads == "slices":
            storage.head_span = spans
    results = []
    for i, (precision, writer, heads, storage, _) in enumerate(variants):
        result = {"precision": precision, "writer": writer, "heads": heads, "pages": num_pages,
                  "layers": storage.layout.num_layers}
        for step in STEPS:
            result[f"{step}_s"] = statistics.median(s[step] for s in samples[i])
        result["total_s"] = statistics.median(sum(s.values()) for s in samples[i])
        results.append(result)
    return results


def markdown(results: list[dict], profile_name: str) -> str:
    lines = [f"One seal of {results[0]['pages']} pages in each of {results[0]['layers']} layers "
             f"({profile_name}; one intra-op thread; alternating), medians, ms.", "",
             "| rows | writer | heads | stats | select | write | total | write vs torch |",
             "|---|---|---|---|---|---|---|---|"]
    torch_write = {r["precision"]: r["write_s"] for r in results
                   if r["writer"] == "torch" and r["heads"] == "slices"}
    for r in results:
        ratio = torch_write.get(r["precision"])
        ratio = f"x{ratio / r['write_s']:.1f}" if ratio and r["write_s"] > 0 else "-"
        lines.append(f"| {r['precision']} | {r['writer']} | {r['heads']} | "
                     f"{r['stats_s'] * 1e3:.1f} | {r['select_s'] * 1e3:.1f} | "
                     f"{r['write_s'] * 1e3:.1f} | {r['total_s'] * 1e3:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--precision", nargs="+", default=["bf16", "int4"],
                        help="row precisions of the profile to seal (bf16 = drop-only)")
    parser.add_argument("--pages", type=int, default=4,
                        help="pages per seal (a 256-token prefill chunk seals 4 of 64 tokens)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--writers", nargs="+", choices=WRITERS, default=list(WRITERS),
                        help="row writers to time side by side (native: cuda_ext/seal.cpp)")
    parser.add_argument("--index-heads", action="store_true",
                        help="also time the torch writer with every group's KV heads indexed")
    parser.add_argument("--out", type=Path, default=Path("results/seal"))
    args = parser.parse_args()
    if args.pages < 1:
        parser.error("--pages must be at least 1")
    profile = BudgetProfile.load(args.profile)
    if profile.model is None:
        parser.error(f"{args.profile} names no model; the shapes come from its model")
    torch.manual_seed(0)
    print(f"sealing {args.pages} pages x {profile.num_layers} layers, "
          f"{args.warmup} + {args.repeats} rounds of {len(args.precision)} precision(s) ...",
          flush=True)
    results = measure(profile, args.precision, args.pages, args.warmup, args.repeats,
                      args.index_heads, tuple(args.writers))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seal.json").write_text(json.dumps(
        {"profile": str(args.profile), "results": results}, indent=2))
    table = markdown(results, args.profile.name)
    (args.out / "seal.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
