"""What the CPU microbenchmarks over row counts share (bench.cpu_gemm, bench.cpu_ops): their
arguments, the sweep over (threads, rows) with progress, and the files they write (`write`,
which the served CPU benchmarks bench.gemm_serving and bench.omp_spin use too)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from sgl_ragged import native

Measure = Callable[..., list[dict]]  # (rows, threads, warmup, repeats, progress=...) -> results
T = TypeVar("T")


def round_order(items: Iterable[T], round_: int) -> list[T]:
    """`items` in their order in even rounds, reversed in odd ones: what runs first in a round
    swaps, so neither side of an A/B always follows the other (bench.omp_spin's fixed order once
    biased a served A/B by up to 14%; docs/results.md, "Decode's small products on both
    cores")."""
    items = list(items)
    return items if round_ % 2 == 0 else items[::-1]


def parse(doc: str, *, rows: list[int], threads: list[int], warmup: int, repeats: int,
          out: str, extra: Callable[[argparse.ArgumentParser], None] | None = None,
          ) -> argparse.Namespace:
    """--rows, --threads, --warmup, --repeats and --out with these defaults, checked (`extra`
    adds a benchmark's own arguments)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=rows)
    parser.add_argument("--threads", type=int, nargs="+", default=threads)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", type=Path, default=Path(out))
    args = parser.parse_args()
    if min(args.rows) < 1 or min(args.threads) < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--rows, --threads and --repeats must be at least 1, --warmup at least 0")
    return args


def sweep(args: argparse.Namespace, measure: Measure) -> list[dict]:
    """measure() over every (threads, rows), a progress line each; the native kernels are built
    (if needed) before the clock runs."""
    native.load()
    total = len(args.rows) * len(args.threads)
    done = iter(range(1, total + 1))
    return measure(args.rows, args.threads, args.warmup, args.repeats,
                   progress=lambda line: print(f"[{next(done)}/{total}] {line} ...", flush=True))


def write(out: Path, stem: str, payload: dict[str, Any], table: str) -> None:
    """out/<stem>.json and out/<stem>.md; the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{stem}.md").write_text(table)
    print(table)
