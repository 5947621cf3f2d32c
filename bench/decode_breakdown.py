"""Where decode attention's time goes: the split, tail and merge kernels of one decode step,
eager and under a CUDA graph, for the AOT split map and uniform splits, and what the split
kernel's launch configuration (warps, BLOCK_N) would change (`--sweep WARPS:BLOCK_N ...`).

    python -m bench.decode_breakdown [--precision int4] [--batch 4 16] [--context 8192 65536] \
        --out results/decode_breakdown

Same shapes and synthetic profile as bench.decode_attention; with `--precision`, every case also
runs rows with that low tier composed from the same budgets (equal bytes; the split map
gives their groups equal shares), beside the drop-only rows, as bench.decode_attention does. Per case: the step's median time
eager and replayed from a CUDA graph (no launch overhead), and each kernel's device time per
step (torch.profiler over eager steps). N_CTA is what serving measures from the compiled split
kernel (triton_impl.decode_parallelism) in its shipped configuration (decode.DECODE_LAUNCH,
marked in the table). The sweep rebuilds the kernels with another num_warps for the split
kernel and another BLOCK_N (split and tail kernels) at that same N_CTA. Writes decode_breakdown.json and decode_breakdown.md. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.decode_attention import (
    GQA,
    HEAD_DIM,
    HEADS,
    LAYERS,
    add_case_args,
    bench_profile,
    build_case,
    bytes_read,
    fits,
    timed,
)
from sgl_ragged.precision import FULL_PRECISION

CASES = ((4, 8192), (4, 65536), (16, 8192), (16, 65536), (64, 8192))
SWEEP = ((2, 16), (1, 16), (4, 16), (2, 32), (4, 32))  # (split-kernel warps, BLOCK_N)


@contextmanager
def split_config(warps: int, block_n: int) -> Iterator[None]:
    """Build the decode kernels with `warps` for the split kernel and `block_n` for the split
    and tail kernels, whatever the rows (decode.DECODE_LAUNCH)."""
    from sgl_ragged.kernels import decode

    saved = decode.DECODE_LAUNCH
    decode.DECODE_LAUNCH = dict.fromkeys(saved, (warps, block_n))
    try:
        yield
    finally:
        decode.DECODE_LAUNCH = saved


def graph_seconds(step: Callable[[], object], repeats: int) -> float:
    """Median seconds of one replay of `step` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture: compiles, allocates
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return timed(graph.replay, 3, repeats)


def kernel_seconds(step: Callable[[], object], steps: int = 3) -> dict[str, float]:
    """Device seconds per step of each kernel `step` launches (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    result = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            result[event.key] = us / 1e6 / steps
    return result


def measure(profile, batch: int, context: int, warmup: int, repeats: int,
            precision: str = FULL_PRECISION, sweep=SWEEP) -> list[dict]:
    """One row per (split config, strategy) for this batch, context and row precision."""
    from sgl_ragged.attention_backend.registry import profile_split_ratios
    from sgl_ragged.attention_backend.triton_impl import decode_parallelism
    from sgl_ragged.kernels.aot import SplitStrategy, split_plan
    from sgl_ragged.kernels.batch import kernel_batch
    from sgl_ragged.kernels.decode import decode_attention
    from sgl_ragged.kernels.tables import all_layer_tables

    storage, plans, (q, k, v) = build_case(profile, batch, context, precision)
    tables, batch_t = all_layer_tables(storage), kernel_batch(plans, "cuda")
    ratios = profile_split_ratios(storage, profile)  # equal shares when rows have a low tier
    ctas = decode_parallelism(storage, tables[0], ratios, HEADS * GQA)
    rows, nbytes = [], bytes_read(storage, batch, context)
    for warps, block_n in sweep:
        for strategy in SplitStrategy:
            splits = split_plan(ratios, ctas, "cuda", strategy)

            def step(splits=splits):
                for layer in range(LAYERS):
                    decode_attention(q, k, v, storage.stage_k[layer], storage.stage_v[layer],
                                     tables[layer], splits.layer(layer), batch_t, HEAD_DIM**-0.5)

            with split_config(warps, block_n):
                eager, graphed = timed(step, warmup, repeats), graph_seconds(step, repeats)
                kernels = kernel_seconds(step)
            rows.append({
                "batch": batch, "context": context, "precision": precision, "num_ctas": ctas,
                "warps": warps,
                "block_n": block_n, "strategy": strategy.value,
                "max_splits": max(s.max_splits for s in splits.layers), "eager_s": eager,
                "graph_s": graphed, "graph_gbps": nbytes / graphed / 1e9, "kernels_s": kernels})
    return rows


def kernel_ms(row: dict, name: str) -> str:
    return f"{sum(t for k, t in row['kernels_s'].items() if name in k) * 1e3:.2f}"


def shipped(row: dict) -> str:
    """' (shipped)' where the row's configuration is decode.DECODE_LAUNCH's for its rows."""
    from sgl_ragged.kernels.decode import DECODE_LAUNCH

    rows = "rows" if row.get("precision", FULL_PRECISION) == FULL_PRECISION else "codes"
    return " (shipped)" if DECODE_LAUNCH[rows] == (row["warps"], row["block_n"]) else ""


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"Decode attention per step (32 layers) on {device}: split, tail and merge kernels "
             "(device ms per step), eager and CUDA-graph step.", "",
             "| batch | context | rows | N_CTA | warps | BLOCK_N | strategy | max S | split ms "
             "| tail ms | merge ms | eager ms | graph ms | graph GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r.get('precision', FULL_PRECISION)} "
            f"| {r['num_ctas']} | {r['warps']} | {r['block_n']}{shipped(r)} "
            f"| {r['strategy']} | {r['max_splits']} | {kernel_ms(r, '_sealed_splits_kernel')} "
            f"| {kernel_ms(r, '_tail_kernel')} | {kernel_ms(r, '_merge_kernel')} "
            f"| {r['eager_s'] * 1e3:.2f} "
            f"| {r['graph_s'] * 1e3:.2f} | {r['graph_gbps']:.0f} |")
    return "\n".join(lines) + "\n"


def cases(batches: list[int] | None, contexts: list[int] | None) -> list[tuple[int, int]]:
    """(batch, context) pairs: the default CASES, or every pair of the given values (one list
    given: CASES filtered by it)."""
    if batches and contexts:
        return [(b, c) for b in batches for c in contexts]
    return [(b, c) for b, c in CASES
            if (not batches or b in batches) and (not contexts or c in contexts)]


def sweep_config(text: str) -> tuple[int, int]:
    """argparse type of one --sweep entry, WARPS:BLOCK_N."""
    try:
        warps, block_n = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write a configuration as WARPS:BLOCK_N, "
                                         "for example 2:16") from None
    if warps not in (1, 2, 4, 8) or block_n not in (16, 32, 64, 128):
        raise argparse.ArgumentTypeError(f"{text!r}: warps must be 1, 2, 4 or 8 and BLOCK_N "
                                         "16, 32, 64 or 128")
    return warps, block_n


def write(out: Path, rows: list[dict], device: str, profile_name: str) -> str:
    """decode_breakdown.json and .md of the rows so far; the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_breakdown.json").write_text(
        json.dumps({"device": device, "profile": profile_name, "rows": rows}, indent=2))
    table = markdown(rows, device)
    (out / "decode_breakdown.md").write_text(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser, batch=None, context=None)  # default: CASES
    parser.add_argument("--sweep", type=sweep_config, nargs="+", default=list(SWEEP),
                        help="split-kernel configurations WARPS:BLOCK_N to time (default: "
                        + " ".join(f"{w}:{n}" for w, n in SWEEP) + ")")
    parser.add_argument("--out", type=Path, default=Path("results/decode_breakdown"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_breakdown.py needs a CUDA device; nothing measured.")
        sys.exit(0)
    profile, name = bench_profile(args.profile, args.heads_per_group)
    torch.manual_seed(0)
    cap = torch.cuda.mem_get_info()[0] * args.mem_fraction
    rows, device = [], torch.cuda.get_device_name()
    for batch, context in cases(args.batch, args.context):
        for precision in dict.fromkeys([FULL_PRECISION, args.precision]):
            if fits(profile, batch, context, cap, precision):
                print(f"batch {batch}, context {context}, {precision} ...", flush=True)
                rows += measure(profile, batch, context, args.warmup, args.repeats, precision,
                                args.sweep)
                torch.cuda.empty_cache()
                write(args.out, rows, device, name)  # what a run cut short has measured
    print(write(args.out, rows, device, name))


if __name__ == "__main__":
    main()
