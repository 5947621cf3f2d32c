"""bfloat16 dense layers on the CPU: torch's bfloat16 product, compat/cpu_gemm's float32 one and
the native kernel (cuda_ext/linear.cpp), in the same rounds.

    python -m bench.cpu_gemm [--rows 1 2 4 ... 256 512] [--threads 1 2] --out results/cpu-gemm
    GOMP_SPINCOUNT=3000 python -m bench.cpu_gemm --rows 1 4 16 --threads 2 \
        --dot-serial-macs 4194304 262144
    python -m bench.cpu_gemm --rows 1 8 16 --threads 2 \
        --baseline $(python -m bench.native_baseline --rev main | tail -1)

The dense layers of the default model (SmolLM2-135M: hidden 576, intermediate 1536, 9 query and
3 KV heads of 64, a 49152-token vocabulary), each multiplied as SGLang does (`F.linear` of
bfloat16 rows and weights; the lm_head by `torch.matmul`, the same product), as
`cpu_gemm.linear` does (both converted to float32, rounded to bfloat16 once) and by the native
kernel (the weight read as bfloat16, float32 sums, rounded once). A model step is every layer's
four products over 30 layers of distinct weights (212 MB, more than the caches hold: the weights
stream from memory as in a server); the lm_head (56 MB) is timed on its own. Each round times
every variant once, in turn (alternating, the order reversed every other round); medians over
the repeats after warm-up. The native kernel runs with this process's split threshold for
its dots (compat/cpu_gemm.dot_serial_macs: from the OpenMP spin count); `--dot-serial-macs A B
...` adds the native kernel at each of those thresholds as variants `native@A` ... in the same
rounds (ratios against the first); `--baseline SO` adds another build's kernel
(bench.native_baseline) at the same threshold as `baseline`, its products checked against this
build's first. Row counts stand for a decode batch's requests or a prefill chunk's tokens.
Writes cpu_gemm.json and cpu_gemm.md. compat/cpu_gemm.py's FLOAT32_ROWS and linear.cpp's
DOT_ROWS (where torch's bfloat16 product overtakes the dots on an AVX512-BF16 CPU) come from
this table; linear.cpp's QUAD_ROWS and PANEL_ROWS from the same model step timed against a
build of the other layouts (`--baseline`; docs/results.md, "Prefill's dense layers on the native
kernel" and "Decode's dense layers in split quads").
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from bench import cpu_sweep
from bench.cpu_attention import load_baseline
from sgl_ragged import native
from sgl_ragged.attention_backend import ops
from sgl_ragged.compat import cpu_gemm

# (name, in features, out features) of one decoder layer of SmolLM2-135M
LAYERS = (("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072),
          ("down_proj", 1536, 576))
NUM_LAYERS = 30
LM_HEAD = (576, 49152)  # hidden, vocabulary
Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
VARIANTS: dict[str, Product] = {
    "bfloat16": lambda x, w: F.linear(x, w),
    "float32": lambda x, w: cpu_gemm.linear(x, w, None),
    "native": lambda x, w: cpu_gemm.kernel().linear_bf16(x, w, None),
}


def _weights(num_layers: int, vocab: int, gen: torch.Generator) -> tuple[list, torch.Tensor]:
    layers = [[(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for _, k, n in LAYERS]
              for _ in range(num_layers)]
    head = (torch.randn(vocab, LM_HEAD[0], generator=gen) / LM_HEAD[0]**0.5).bfloat16()
    return layers, head


def at_threshold(macs: int) -> Product:
    """The native kernel with its dots' split threshold at `macs` products for this call (the
    process's own restored after it)."""

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        module = cpu_gemm.kernel()
        own = module.linear_dot_serial_macs()
        module.set_linear_dot_serial_macs(macs)
        try:
            return module.linear_bf16(x, w, None)
        finally:
            module.set_linear_dot_serial_macs(own)

    return product


def same_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two builds' bfloat16 products of the same operands: float32 sums of the same products,
    perhaps in another order (another form of the kernel), each rounded to bfloat16 once, so
    within a bfloat16 step of each other (1e-6 absolute for sums that cancel)."""
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= 2.0**-7 * torch.maximum(a.abs(), b.abs()) + 1e-6).all())


def measure(rows: list[int], threads: list[int], warmup: int, repeats: int,
            num_layers: int = NUM_LAYERS, vocab: int = LM_HEAD[1],
            progress: Callable[[str], None] = lambda line: None,
            dot_serial_macs: list[int] | None = None,
            baseline: ModuleType | None = None) -> list[dict]:
    """Median seconds of each variant's model step and lm_head per (threads, rows); with
    `dot_serial_macs`, the native kernel at each threshold too (`native@<macs>`); with
    `baseline`, another build's kernel (`baseline`)."""
    variants = dict(VARIANTS)
    for macs in dot_serial_macs or []:
        variants[f"native@{macs}"] = at_threshold(macs)
    if baseline is not None:
        baseline.set_linear_dot_serial_macs(cpu_gemm.kernel().linear_dot_serial_macs())
        variants["baseline"] = lambda x, w: baseline.linear_bf16(x, w, None)
    gen = torch.Generator().manual_seed(0)
    layers, head = _weights(num_layers, vocab, gen)
    results = []
    for t in threads:
        with ops.intra_op_threads(t):
            for m in rows:
                progress(f"{t} thread(s), {m} rows")
                xs = [torch.randn(m, k, generator=gen).bfloat16() for _, k, _ in LAYERS]
                hidden = torch.randn(m, LM_HEAD[0], generator=gen).bfloat16()
                if baseline is not None:  # the same products, or the ratio means nothing
                    for x, w in zip(xs, layers[0], strict=True):
                        theirs, ours = variants["baseline"](x, w), variants["native"](x, w)
                        if not same_rounding(theirs, ours):
                            raise SystemExit(f"--baseline computes other products than this "
                                             f"build at {m} rows: compare builds of one rounding")
                step: dict[str, list[float]] = {v: [] for v in variants}
                lm: dict[str, list[float]] = {v: [] for v in variants}
                for round_ in range(warmup + repeats):
                    for variant, fn in cpu_sweep.round_order(variants.items(), round_):
                        t0 = time.perf_counter()
                        for weights in layers:
                            for x, w in zip(xs, weights, strict=True):
                                fn(x, w)
                        t1 = time.perf_counter()
                        fn(hidden, head)
                        t2 = time.perf_counter()
                        if round_ >= warmup:
                            step[variant].append(t1 - t0)
                            lm[variant].append(t2 - t1)
                results.append({"threads": t, "rows": m, "layers": num_layers,
                                **{f"{v}_step_s": statistics.median(s) for v, s in step.items()},
                                **{f"{v}_lm_head_s": statistics.median(s) for v, s in lm.items()}})
    return results


def markdown(results: list[dict]) -> str:
    layers = results[0]["layers"] if results else NUM_LAYERS
    lines = [f"Dense products of SmolLM2-135M on the CPU: a model step ({layers} layers of distinct "
             "weights, four products each) and the lm_head; torch's bfloat16 product, float32 "
             "(compat/cpu_gemm.linear) and the native kernel (cuda_ext/linear.cpp); alternating "
             "rounds, medians. Ratios above 1: the native kernel is faster.", "",
             "| threads | rows | step bfloat16 ms | step float32 ms | step native ms | "
             "bfloat16 / native | float32 / native | lm_head bfloat16 ms | lm_head native ms | "
             "bfloat16 / native |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, f, n = (r[f"{v}_step_s"] * 1e3 for v in VARIANTS)
        hb, hn = r["bfloat16_lm_head_s"] * 1e3, r["native_lm_head_s"] * 1e3
        lines.append(f"| {r['threads']} | {r['rows']} | {b:.1f} | {f:.1f} | {n:.1f} | "
                     f"x{b / n:.2f} | x{f / n:.2f} | {hb:.1f} | {hn:.1f} | x{hb / hn:.2f} |")
    if results and "baseline_step_s" in results[0]:
        lines += ["", "Another build of the kernel (`--baseline`), same rounds and split "
                  "threshold:", "",
                  "| threads | rows | baseline step ms | native step ms | baseline / native | "
                  "baseline lm_head ms | native lm_head ms | baseline / native |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results:
            b, n = r["baseline_step_s"] * 1e3, r["native_step_s"] * 1e3
            hb, hn = r["baseline_lm_head_s"] * 1e3, r["native_lm_head_s"] * 1e3
            lines.append(f"| {r['threads']} | {r['rows']} | {b:.2f} | {n:.2f} | x{b / n:.2f} | "
                         f"{hb:.2f} | {hn:.2f} | x{hb / hn:.2f} |")
    thresholds = [k[:-len("_step_s")] for k in results[0] if k.startswith("native@")
                  and k.endswith("_step_s")] if results else []
    if thresholds:
        first = thresholds[0]
        lines += ["", "The native kernel's dots at each split threshold (products below which a "
                  f"call stays on one thread), same rounds; ratios against {first}:", "",
                  "| threads | rows | " + " | ".join(f"{t} step ms" for t in thresholds) + " | "
                  + " | ".join(f"{first} / {t}" for t in thresholds[1:]) + " |",
                  "|---|---|" + "---|" * (2 * len(thresholds) - 1)]
        for r in results:
            ms = [r[f"{t}_step_s"] * 1e3 for t in thresholds]
            lines.append(f"| {r['threads']} | {r['rows']} | " + " | ".join(f"{m:.1f}" for m in ms)
                         + " | " + " | ".join(f"x{ms[0] / m:.2f}" for m in ms[1:]) + " |")
    flags = native.cpu_flags()
    lines += ["", f"CPU: {torch.backends.cpu.get_cpu_capability()} in torch; "
              f"amx_bf16 {'amx_bf16' in flags}, avx512_bf16 {'avx512_bf16' in flags}; the native "
              f"kernel's form: {native.load().linear_isa()} (vdpbf16ps dots below "
              f"{native.load().linear_dot_rows()} rows, split from "
              f"{cpu_gemm.kernel().linear_dot_serial_macs()} products); RAGGED_CPU_GEMM=auto "
              "routes here: "
              f"{cpu_gemm.routes()} ({cpu_gemm.CHOICES['auto']})."]
    return "\n".join(lines) + "\n"


def _threshold_arg(parser) -> None:
    parser.add_argument("--dot-serial-macs", type=int, nargs="+", default=None, metavar="MACS",
                        help="also the native kernel at each of these split thresholds")
    parser.add_argument("--baseline", type=Path, default=None, metavar="SO",
                        help="also another build of the kernel (python -m bench.native_baseline "
                             "--rev R prints its path)")


def main() -> None:
    args = cpu_sweep.parse(__doc__, rows=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512], threads=[1, 2],
                           warmup=1, repeats=5, out="results/cpu-gemm", extra=_threshold_arg)
    if args.dot_serial_macs and min(args.dot_serial_macs) < 0:
        raise SystemExit("--dot-serial-macs: counts of products are at least 0")
    baseline = load_baseline(args.baseline) if args.baseline else None
    results = cpu_sweep.sweep(args, functools.partial(measure, baseline=baseline,
                                                      dot_serial_macs=args.dot_serial_macs))
    cpu_sweep.write(args.out, "cpu_gemm", {
        "results": results, "native_isa": native.load().linear_isa(),
        "native_dot_rows": native.load().linear_dot_rows(),
        "native_dot_serial_macs": cpu_gemm.kernel().linear_dot_serial_macs(),
        "cpu_flags": sorted(native.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})},
        markdown(results))

if __name__ == "__main__":
    main()
