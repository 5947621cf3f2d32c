"""Where decode attention's time goes: the split, tail and merge kernels of one decode step,
eager and under a CUDA graph, for several split maps (`--splits`), caps on the split kernel's
programs per SM (`--programs-per-sm`) and launch configurations of the split kernel
(`--sweep WARPS:BLOCK_N[:STAGES] ...`), with the low tier attended page by page or pages packed
into the dots' rows (`--pack off on`, launch.packed_pages).

    python -m bench.decode_breakdown [--precision int4] [--batch 4 16] [--context 8192 65536] \
        [--programs-per-sm 2 4 8] [--sweep shipped 2:16 2:16:3] [--splits uniform aot cost] \
        [--pack off on] --out results/decode_breakdown

Same shapes and synthetic profile as bench.decode_attention; with `--precision`, every case also
runs rows with that low tier composed from the same budgets (equal bytes), beside the drop-only
rows, as bench.decode_attention does. Per case and variant: the step's median time eager and
replayed from a CUDA graph (no launch overhead), and each kernel's device time per step
(torch.profiler over eager steps).

- N_CTA is what serving measures from the compiled split kernel in its shipped launch
  (triton_impl.decode_parallelism: SMs x resident programs per SM), with each
  `--programs-per-sm` value in place of the cap aot.MAX_PROGRAMS_PER_SM (serving's 2 by default).
- Split maps (split_plan_of): `uniform`, `aot` (byte-weighted) and `cost[:F]`
  (aot.cost_split_ratios at the launch's BLOCK_N, fold constant F).
- The sweep rebuilds the kernels with another num_warps and num_stages (software pipelining)
  for the split kernel and another BLOCK_N (split and tail kernels) at the same N_CTA;
  `shipped` is decode.DECODE_LAUNCH's launch for the case's rows, and WARPS:BLOCK_N without
  STAGES takes its stages.
- `--pack on` also times every quantized case with RAGGED_TRITON_PACK=1 (launch.packed_pages:
  the split kernel attends several low-tier pages at once, one per repeat of the query heads'
  rows); drop-only rows have nothing to pack.

The table marks the rows serving runs (its launch, split map and cap). Writes
decode_breakdown.json and decode_breakdown.md after every case (a run cut short keeps what it
measured). Needs CUDA; exits 0 without it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from sgl_ragged.kernels.aot import (
    FOLD_TILES,
    MAX_PROGRAMS_PER_SM,
    SplitPlan,
    SplitStrategy,
    cost_split_ratios,
    layout_split_ratios,
    split_plan,
)
from sgl_ragged.precision import FULL_PRECISION

CASES = ((4, 8192), (4, 65536), (16, 8192), (16, 65536), (64, 8192))
SWEEP = ((2, 16), (1, 16), (4, 16), (2, 32), (4, 32))  # (split-kernel warps, BLOCK_N)
Launch = tuple[int, int, int]  # (split-kernel warps, BLOCK_N, split-kernel stages)
SHIPPED = "shipped"  # a --sweep entry: decode.DECODE_LAUNCH's launch for the case's rows
SPLITS = ("aot", "uniform")  # default --splits
PACK = {"off": False, "on": True}  # --pack choices: launch.packed_pages' RAGGED_TRITON_PACK


@dataclass(frozen=True)
class Variants:
    """What every case is measured under: caps on the split kernel's programs per SM (N_CTA),
    its launches ((warps, BLOCK_N[, stages]) or SHIPPED) and split maps (split_choice's
    names)."""

    programs_per_sm: tuple[int, ...] = (MAX_PROGRAMS_PER_SM,)
    sweep: tuple[tuple[int, ...] | str, ...] = SWEEP
    splits: tuple[str, ...] = SPLITS
    pack: tuple[bool, ...] = (False,)

    def launches(self, precision: str, pack: bool = False) -> list[Launch]:
        """The sweep's (warps, BLOCK_N, stages) for rows of `precision` (with packed pages or
        not), SHIPPED and missing stages read from decode.DECODE_LAUNCH; each once, in order."""
        from sgl_ragged.kernels.decode import DECODE_LAUNCH

        shipped = DECODE_LAUNCH[launch_kind(precision, pack)]
        return list(dict.fromkeys(shipped if c == SHIPPED else (*c, *shipped[len(c):])
                                  for c in self.sweep))


def launch_kind(precision: str, pack: bool = False) -> str:
    """decode.DECODE_LAUNCH's key for rows of `precision`: "rows" drop-only, "codes" quantized,
    "packed" quantized with packed pages."""
    return "rows" if precision == FULL_PRECISION else "packed" if pack else "codes"


@contextmanager
def split_config(launch: Launch) -> Iterator[None]:
    """Build the decode kernels with this (warps, BLOCK_N, stages): warps and stages for the
    split kernel, BLOCK_N for the split and tail kernels, whatever the rows
    (decode.DECODE_LAUNCH)."""
    from sgl_ragged.kernels import decode

    saved = decode.DECODE_LAUNCH
    decode.DECODE_LAUNCH = dict.fromkeys(saved, launch)
    try:
        yield
    finally:
        decode.DECODE_LAUNCH = saved


@contextmanager
def packed(on: bool) -> Iterator[None]:
    """RAGGED_TRITON_PACK as `on` says while the kernels are built and launched (the split
    kernel's GP is a constexpr: each setting compiles its own build)."""
    import os

    saved = os.environ.get("RAGGED_TRITON_PACK")
    os.environ["RAGGED_TRITON_PACK"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAGGED_TRITON_PACK")
        else:
            os.environ["RAGGED_TRITON_PACK"] = saved


def split_plan_of(split: str, storage, profile, num_ctas: int, block_n: int) -> SplitPlan:
    """The split map `split` names for this storage, at N_CTA and BLOCK_N:

    - uniform: the same splits for every group (what serving's equal shares for quantized
      layouts give);
    - aot: Algorithm 1 on the profile's ratios for drop-only rows (as served), on the layout's
      bytes per group for quantized rows (aot.layout_split_ratios: the map session 13 timed
      against uniform);
    - cost[:F]: Algorithm 1 on aot.cost_split_ratios with fold constant F (aot.FOLD_TILES
      where left out)."""
    from sgl_ragged.attention_backend.registry import profile_split_ratios

    name, _, fold = split.partition(":")
    layout = storage.layout
    if name == SplitStrategy.UNIFORM:
        return split_plan(layout_split_ratios(layout), num_ctas, storage.device,
                          SplitStrategy.UNIFORM)
    if name == SplitStrategy.AOT:
        ratios = (layout_split_ratios(layout) if layout.quantized
                  else profile_split_ratios(storage, profile))
    else:
        ratios = cost_split_ratios(layout, block_n, float(fold) if fold else FOLD_TILES)
    return split_plan(ratios, num_ctas, storage.device)


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


def timings(step: Callable[[], object], launch: Launch, warmup: int, repeats: int,
            pack: bool = False) -> dict:
    """eager_s, graph_s and kernels_s of `step` with the split kernel built for this launch
    (and packed pages or not)."""
    with split_config(launch), packed(pack):
        return {"eager_s": timed(step, warmup, repeats), "graph_s": graph_seconds(step, repeats),
                "kernels_s": kernel_seconds(step)}


def measure(profile, batch: int, context: int, warmup: int, repeats: int,
            precision: str = FULL_PRECISION, variants: Variants = Variants()) -> list[dict]:
    """One row per (programs-per-SM cap, launch, split map) for this batch, context and row
    precision."""
    from sgl_ragged.attention_backend.registry import profile_split_ratios
    from sgl_ragged.attention_backend.triton_impl import decode_parallelism
    from sgl_ragged.kernels.batch import kernel_batch
    from sgl_ragged.kernels.decode import decode_attention
    from sgl_ragged.kernels.launch import block_config, joined_safe, packed_pages, split_planes
    from sgl_ragged.kernels.tables import all_layer_tables

    storage, plans, (q, k, v) = build_case(profile, batch, context, precision)
    tables, batch_t = all_layer_tables(storage), kernel_batch(plans, "cuda")
    ratios = profile_split_ratios(storage, profile)  # sizes decode_parallelism's probe only
    rows, nbytes = [], bytes_read(storage, batch, context)
    for per_sm in variants.programs_per_sm:
        ctas = decode_parallelism(storage, tables[0], ratios, HEADS * GQA, per_sm)
        for pack in variants.pack:
            with packed(pack):
                gp = packed_pages(q, tables[0], block_config(q, GQA, HEAD_DIM))
            if pack and not gp:
                continue  # nothing to pack: the same kernel as unpacked
            for (warps, block_n, stages), split in ((c, s) for c in variants.launches(precision, pack)
                                                    for s in variants.splits):
                splits = split_plan_of(split, storage, profile, ctas, block_n)

                def step(splits=splits):
                    for layer in range(LAYERS):
                        decode_attention(q, k, v, storage.stage_k[layer],
                                         storage.stage_v[layer], tables[layer],
                                         splits.layer(layer), batch_t, HEAD_DIM**-0.5)

                # BLOCK_N as launched: launch.joined_safe raises it for joined code planes.
                ran = joined_safe({"BLOCK_N": block_n, "D": HEAD_DIM}, q, tables[0])["BLOCK_N"]
                row = {"batch": batch, "context": context, "precision": precision,
                       "programs_per_sm": per_sm, "num_ctas": ctas, "warps": warps,
                       "launch": [warps, block_n, stages], "block_n": ran, "stages": stages,
                       "split_planes": split_planes(q, tables[0], HEAD_DIM),
                       "strategy": split, "packed_pages": gp,
                       "max_splits": max(s.max_splits for s in splits.layers),
                       **timings(step, (warps, block_n, stages), warmup, repeats, pack)}
                rows.append({**row, "graph_gbps": nbytes / row["graph_s"] / 1e9})
    return rows


def kernel_ms(row: dict, name: str) -> str:
    return f"{sum(t for k, t in row['kernels_s'].items() if name in k) * 1e3:.2f}"


def launch_of(row: dict) -> Launch:
    """A row's split-kernel launch (warps, BLOCK_N as swept, stages); rows written before
    "launch" was recorded give BLOCK_N as launched."""
    return tuple(row.get("launch") or (row["warps"], row["block_n"], row["stages"]))


def served(row: dict) -> bool:
    """Whether the row is what serving runs for its rows: decode.DECODE_LAUNCH's launch,
    registry.profile_split_ratios' map (the profile's ratios for drop-only rows, equal shares,
    i.e. uniform splits, for quantized ones) and the cap aot.MAX_PROGRAMS_PER_SM."""
    from sgl_ragged.kernels.decode import DECODE_LAUNCH

    kind = launch_kind(row["precision"])
    return (DECODE_LAUNCH[kind] == launch_of(row)
            and row["strategy"] == (SplitStrategy.AOT if kind == "rows" else SplitStrategy.UNIFORM)
            and row["programs_per_sm"] == MAX_PROGRAMS_PER_SM and not row.get("packed_pages"))


def unpacked_ratio(row: dict, rows: list[dict]) -> str:
    """A packed row's graph step over the unpacked one of its case, cap and split map (at
    decode.DECODE_LAUNCH's launch for codes where that ran, else the first), as "x0.83"; ""
    for other rows or where no unpacked row ran."""
    from sgl_ragged.kernels.decode import DECODE_LAUNCH

    if not row.get("packed_pages"):
        return ""
    key = ("batch", "context", "precision", "programs_per_sm", "strategy")
    same = [r for r in rows if not r.get("packed_pages") and all(r[k] == row[k] for k in key)]
    same.sort(key=lambda r: launch_of(r) != DECODE_LAUNCH["codes"])
    return f"x{row['graph_s'] / same[0]['graph_s']:.2f}" if same else ""


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"Decode attention per step (32 layers) on {device}: split, tail and merge kernels "
             "(device ms per step), eager and CUDA-graph step; cap/SM: the most programs per "
             "SM N_CTA counts; x unpacked: a packed row's graph step over the unpacked one of "
             "its case and split map (the shipped launch); served: serving's launch, split map "
             "and cap.", "",
             "| batch | context | rows | cap/SM | N_CTA | warps | BLOCK_N | stages | strategy "
             "| max S | split ms | tail ms | merge ms | eager ms | graph ms | graph GB/s "
             "| x unpacked | served |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} "
            f"| {r['precision']}{' (split planes)' if r.get('split_planes') else ''}"
            f"{' (packed)' if r.get('packed_pages') else ''} "
            f"| {r['programs_per_sm']} "
            f"| {r['num_ctas']} | {r['warps']} | {r['block_n']} | {r['stages']} "
            f"| {r['strategy']} "
            f"| {r['max_splits']} | {kernel_ms(r, '_sealed_splits_kernel')} "
            f"| {kernel_ms(r, '_tail_kernel')} | {kernel_ms(r, '_merge_kernel')} "
            f"| {r['eager_s'] * 1e3:.2f} | {r['graph_s'] * 1e3:.2f} | {r['graph_gbps']:.0f} "
            f"| {unpacked_ratio(r, rows)} | {'yes' if served(r) else ''} |")
    return "\n".join(lines) + "\n"


def cases(batches: list[int] | None, contexts: list[int] | None) -> list[tuple[int, int]]:
    """(batch, context) pairs: the default CASES, or every pair of the given values (one list
    given: CASES filtered by it)."""
    if batches and contexts:
        return [(b, c) for b in batches for c in contexts]
    return [(b, c) for b, c in CASES
            if (not batches or b in batches) and (not contexts or c in contexts)]


def sweep_config(text: str) -> tuple[int, ...] | str:
    """argparse type of one --sweep entry: WARPS:BLOCK_N[:STAGES], or SHIPPED."""
    if text == SHIPPED:
        return text
    try:
        parts = tuple(int(x) for x in text.split(":"))
    except ValueError:
        parts = ()
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: write a configuration as "
                                         "WARPS:BLOCK_N[:STAGES], for example 2:16 or 2:16:3, "
                                         f"or {SHIPPED}")
    if parts[0] not in (1, 2, 4, 8) or parts[1] not in (16, 32, 64, 128) or (
            len(parts) == 3 and parts[2] not in (1, 2, 3, 4)):
        raise argparse.ArgumentTypeError(f"{text!r}: warps must be 1, 2, 4 or 8, BLOCK_N 16, "
                                         "32, 64 or 128 and stages 1 to 4")
    return parts


def split_choice(text: str) -> str:
    """argparse type of one --splits entry: uniform, aot, or cost[:F] with a fold constant
    F >= 0 (written cost:F, aot.FOLD_TILES where F is left out)."""
    name, sep, fold = text.partition(":")
    if name in (SplitStrategy.UNIFORM, SplitStrategy.AOT) and not sep:
        return text
    if name == "cost" and (not sep or re.fullmatch(r"\d+\.?\d*|\.\d+", fold)):
        return f"cost:{float(fold) if sep else FOLD_TILES:g}"
    raise argparse.ArgumentTypeError(f"{text!r}: a split map is uniform, aot, cost or cost:F "
                                     "with a fold constant F >= 0 in tiles, for example cost:0.5")


def positive(text: str) -> int:
    """argparse type of one --programs-per-sm entry: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: programs per SM is an integer >= 1")
    return int(text)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser, batch=None, context=None)  # default: CASES
    parser.add_argument("--programs-per-sm", type=positive, nargs="+",
                        default=[MAX_PROGRAMS_PER_SM],
                        help="caps on the split kernel's resident programs per SM that N_CTA "
                        f"counts, each measured (default: serving's {MAX_PROGRAMS_PER_SM})")
    parser.add_argument("--sweep", type=sweep_config, nargs="+", default=list(SWEEP),
                        help="split-kernel configurations WARPS:BLOCK_N[:STAGES] to time (stages "
                        f"left out: the shipped ones), or {SHIPPED} for decode.DECODE_LAUNCH's "
                        "(default: "
                        + " ".join(f"{w}:{n}" for w, n in SWEEP) + ")")
    parser.add_argument("--splits", type=split_choice, nargs="+", default=list(SPLITS),
                        help="split maps to time: uniform, aot (byte-weighted), cost[:F] "
                        f"(aot.cost_split_ratios, fold constant F, default {FOLD_TILES:g}) "
                        "(default: " + " ".join(SPLITS) + ")")
    parser.add_argument("--pack", choices=list(PACK), nargs="+", default=["off"],
                        help="the low tier page by page (off) and/or several pages packed into "
                        "the split kernel's rows (on: RAGGED_TRITON_PACK=1, launch.packed_pages; "
                        "quantized rows only) (default: off)")
    parser.add_argument("--out", type=Path, default=Path("results/decode_breakdown"))
    return parser


def variants_of(args: argparse.Namespace) -> Variants:
    """The parsed options' variants, each value once."""
    return Variants(*(tuple(dict.fromkeys(x)) for x in (args.programs_per_sm, args.sweep,
                                                          args.splits)),
                    pack=tuple(dict.fromkeys(PACK[p] for p in args.pack)))


def write(out: Path, rows: list[dict], device: str, profile_name: str) -> str:
    """decode_breakdown.json and .md of the rows so far; the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_breakdown.json").write_text(
        json.dumps({"device": device, "profile": profile_name, "rows": rows}, indent=2))
    table = markdown(rows, device)
    (out / "decode_breakdown.md").write_text(table)
    return table


def main() -> None:
    args = argument_parser().parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_breakdown.py needs a CUDA device; nothing measured.")
        sys.exit(0)
    profile, name = bench_profile(args.profile, args.heads_per_group)
    torch.manual_seed(0)
    cap = torch.cuda.mem_get_info()[0] * args.mem_fraction
    rows, device, measured = [], torch.cuda.get_device_name(), variants_of(args)
    for batch, context in cases(args.batch, args.context):
        for precision in dict.fromkeys([FULL_PRECISION, args.precision]):
            if fits(profile, batch, context, cap, precision):
                print(f"batch {batch}, context {context}, {precision} ...", flush=True)
                rows += measure(profile, batch, context, args.warmup, args.repeats, precision,
                                measured)
                torch.cuda.empty_cache()
                write(args.out, rows, device, name)  # what a run cut short has measured
    print(write(args.out, rows, device, name))


if __name__ == "__main__":
    main()
