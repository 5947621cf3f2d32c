"""bfloat16 linear layers on the CPU: torch's bfloat16 product against compat/cpu_gemm's float32 one.

    python -m bench.cpu_gemm [--rows 1 4 8 16 32 256] [--threads 1 2] --out results/cpu-gemm

The dense layers of the default model (SmolLM2-135M: hidden 576, intermediate 1536, 9 query and
3 KV heads of 64), each as SGLang's UnquantizedLinearMethod multiplies it (`F.linear` of
bfloat16 rows and weights) and as `cpu_gemm.linear` does (both converted to float32, the product
rounded to bfloat16 once), timed in alternating rounds at every row count (the tokens of a
prefill chunk, or the requests of a decode batch). A model step's sum is over every layer's four
products. Medians over repetitions after warm-up; the ratio is bfloat16 / float32 (above 1: the
float32 products are faster). Writes cpu_gemm.json and cpu_gemm.md. compat/cpu_gemm.py's
FLOAT32_ROWS comes from this table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from sgl_ragged.attention_backend import ops
from sgl_ragged.compat import cpu_gemm

# (name, in features, out features) of one decoder layer of SmolLM2-135M
LAYERS = (("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072),
          ("down_proj", 1536, 576))
NUM_LAYERS = 30
VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bfloat16": lambda x, w: F.linear(x, w),
    "float32": lambda x, w: cpu_gemm.linear(x, w, None),
}


def measure(rows: list[int], threads: list[int], warmup: int, repeats: int) -> list[dict]:
    """Median seconds of each variant for every (threads, rows, layer); alternating rounds."""
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
               for name, k, n in LAYERS}
    results = []
    for t in threads:
        with ops.intra_op_threads(t):
            for m in rows:
                for name, k, _ in LAYERS:
                    x = torch.randn(m, k, generator=gen).bfloat16()
                    w = weights[name]
                    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
                    for round_ in range(warmup + repeats):
                        for variant, fn in VARIANTS.items():
                            t0 = time.perf_counter()
                            fn(x, w)
                            if round_ >= warmup:
                                samples[variant].append(time.perf_counter() - t0)
                    results.append({"threads": t, "rows": m, "layer": name,
                                    **{f"{v}_s": statistics.median(s) for v, s in samples.items()}})
    return results


def model_steps(results: list[dict]) -> list[dict]:
    """Per (threads, rows): the dense products of a whole model step (every layer's four)."""
    steps: dict[tuple[int, int], dict] = {}
    for r in results:
        step = steps.setdefault((r["threads"], r["rows"]), {
            "threads": r["threads"], "rows": r["rows"], **{f"{v}_s": 0.0 for v in VARIANTS}})
        for v in VARIANTS:
            step[f"{v}_s"] += NUM_LAYERS * r[f"{v}_s"]
    return list(steps.values())


def markdown(results: list[dict]) -> str:
    lines = ["Dense products of SmolLM2-135M on the CPU, bfloat16 (torch) vs float32 "
             "(compat/cpu_gemm), alternating rounds, medians.", "",
             "| threads | rows | layer | bfloat16 ms | float32 ms | bfloat16 / float32 |",
             "|---|---|---|---|---|---|"]
    for r in results + [{**s, "layer": f"model step ({NUM_LAYERS} layers)"}
                        for s in model_steps(results)]:
        lines.append(f"| {r['threads']} | {r['rows']} | {r['layer']} | "
                     f"{r['bfloat16_s'] * 1e3:.2f} | {r['float32_s'] * 1e3:.2f} | "
                     f"x{r['bfloat16_s'] / r['float32_s']:.2f} |")
    flags = cpu_gemm.cpu_flags()
    lines += ["", f"CPU: {torch.backends.cpu.get_cpu_capability()} in torch; "
              f"amx_bf16 {'amx_bf16' in flags}, avx512_bf16 {'avx512_bf16' in flags}; "
              f"RAGGED_CPU_GEMM=auto multiplies in "
              f"{'float32' if cpu_gemm.float32_products() else 'bfloat16'} from "
              f"{cpu_gemm.FLOAT32_ROWS} rows."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("results/cpu-gemm"))
    args = parser.parse_args()
    if min(args.rows) < 1 or min(args.threads) < 1:
        parser.error("--rows and --threads must be at least 1")
    results = []
    for i, t in enumerate(args.threads):
        print(f"[{i + 1}/{len(args.threads)}] {t} thread(s): rows {args.rows} x "
              f"{len(LAYERS)} layers ...", flush=True)
        results += measure(args.rows, [t], args.warmup, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_gemm.json").write_text(json.dumps(
        {"results": results, "model_steps": model_steps(results),
         "cpu_flags": sorted(cpu_gemm.cpu_flags() & {"avx2", "avx512f", "avx512_bf16",
                                                      "amx_bf16"})}, indent=2))
    table = markdown(results)
    (args.out / "cpu_gemm.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
