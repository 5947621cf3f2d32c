"""A decoder layer's RMSNorm and rotary embedding on the CPU: SGLang's torch forms
(`forward_native`) against one call of the native kernels (cuda_ext/elementwise.cpp,
compat/cpu_ops.py's hooks), in the same rounds.

    python -m bench.cpu_ops [--rows 1 8 16 64 512 2048] [--threads 2] --out results/cpu-ops
    python -m bench.cpu_ops --baseline $(python -m bench.native_baseline --rev main | tail -1)

The default model's shapes (SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, neox-style
rotary, bfloat16): RMSNorm with the residual added (twice a layer) and without (the model's
last norm), and the rotary embedding of query and key taken as slices of a packed qkv, as the
attention layer has them. A layer's share is two residual norms and one rotary embedding; a model
step 30 layers of it plus one norm. Also the rotation of a rotated server's queries
(`--ragged-rotation hadamard`: `HeadRotations.rotate` of [rows, 9, 64], four such calls a layer
with k, v and the output; its torch form is the dense per-KV-head product a GPU runs), outside
the step share. With `--baseline SO` (another build of cuda_ext/) every native call also runs on
that build, a third form in the same rounds. Each round runs every op in each form 20 times, in
turn (alternating); medians of a call over the repeats after warm-up. Row counts stand for a
decode batch's requests or a prefill chunk's tokens. Writes cpu_ops.json and cpu_ops.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench import cpu_sweep
from sgl_ragged import native
from sgl_ragged.attention_backend import ops
from sgl_ragged.rotation import HeadRotations, Rotation

HIDDEN, HEADS, KV_HEADS, HEAD = 576, 9, 3, 64
NUM_LAYERS = 30
CALLS = 20  # calls per timing (a decode-sized call takes a few microseconds)
OPS = ("add_rms_norm", "rms_norm", "rotary", "hadamard")


def _cases(rows: int, gen: torch.Generator, baseline: ModuleType | None = None,
           ) -> dict[str, dict[str, Callable[[], Any]]]:
    """op -> form -> its call on fresh inputs of `rows` rows: SGLang's torch form, the native
    call, and with `baseline` the same call on that build."""
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    norm = RMSNorm(HIDDEN, eps=1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16()
    x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    res = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    rope = get_rope(HEAD, rotary_dim=HEAD, max_position=8192, base=100000, is_neox_style=True,
                    dtype=torch.bfloat16)
    rope.cos_sin_cache = rope.cos_sin_cache.bfloat16()  # as SGLang keeps it on the CPU
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD, generator=gen).bfloat16()
    q, k, _ = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
    pos = torch.randint(0, 8192, (rows,), generator=gen)
    w, eps, cache = norm.weight.data, norm.variance_epsilon, rope.cos_sin_cache
    dense = HeadRotations(Rotation(HEAD), [0], range(KV_HEADS), native=False)
    signs, q_heads = dense.signs[0], q.view(rows, HEADS, HEAD)

    def native_forms(m: ModuleType) -> dict[str, Callable[[], Any]]:
        return {"add_rms_norm": lambda: m.rms_norm(x, res, w, eps),
                "rms_norm": lambda: m.rms_norm(x, None, w, eps),
                "rotary": lambda: m.rotary_embedding(pos, q, k, cache, HEAD, True),
                "hadamard": lambda: m.hadamard_heads(q_heads, signs, False)}

    forms = {"torch": {"add_rms_norm": lambda: RMSNorm.forward_native(norm, x, res),
                       "rms_norm": lambda: RMSNorm.forward_native(norm, x),
                       "rotary": lambda: RotaryEmbedding.forward_native(rope, pos, q, k),
                       "hadamard": lambda: dense.rotate(q_heads, 0)},
             "native": native_forms(native.load())}
    if baseline is not None:
        forms["baseline"] = native_forms(baseline)
    return {op: {form: calls[op] for form, calls in forms.items()} for op in OPS}


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - t0) / CALLS


def measure(rows: list[int], threads: list[int], warmup: int, repeats: int,
            progress: Callable[[str], None] = lambda line: None,
            baseline: ModuleType | None = None) -> list[dict]:
    """Median seconds of a call of each op in each form per (threads, rows), and a model
    step's share (NUM_LAYERS x (2 add_rms_norm + rotary) + rms_norm) in each form."""
    gen = torch.Generator().manual_seed(0)
    forms = ("torch", "native") + (("baseline",) if baseline is not None else ())
    results = []
    for t in threads:
        with ops.intra_op_threads(t):
            for n in rows:
                progress(f"{t} thread(s), {n} rows")
                cases = _cases(n, gen, baseline)
                times: dict[str, list[float]] = {f"{op}_{form}": [] for op in OPS
                                                 for form in forms}
                for round_ in range(warmup + repeats):
                    for op, calls in cases.items():
                        for form, fn in cpu_sweep.round_order(calls.items(), round_):
                            seconds = _time(fn)
                            if round_ >= warmup:
                                times[f"{op}_{form}"].append(seconds)
                r: dict[str, Any] = {"threads": t, "rows": n,
                                     **{f"{k}_s": statistics.median(v) for k, v in times.items()}}
                for form in forms:
                    r[f"step_{form}_s"] = (NUM_LAYERS * (2 * r[f"add_rms_norm_{form}_s"]
                                                         + r[f"rotary_{form}_s"])
                                           + r[f"rms_norm_{form}_s"])
                results.append(r)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["RMSNorm, the rotary embedding and a rotated server's query rotation of SmolLM2-135M "
             "on the CPU: SGLang's torch forms (the rotation: the dense per-KV-head product) "
             "against one native call (cuda_ext/elementwise.cpp); microseconds a call, "
             f"alternating rounds, medians; a model step's share is {NUM_LAYERS} x (2 residual "
             "norms + 1 rotary) + 1 norm.", "",
             "| threads | rows | add+norm torch | native | norm torch | native | rotary torch | "
             "native | hadamard torch | native | step share torch ms | native ms | "
             "torch / native |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = [f"{r[f'{op}_{form}_s'] * 1e6:.1f}" for op in OPS for form in ("torch", "native")]
        a, b = r["step_torch_s"] * 1e3, r["step_native_s"] * 1e3
        lines.append(f"| {r['threads']} | {r['rows']} | " + " | ".join(cells)
                     + f" | {a:.2f} | {b:.2f} | x{a / b:.2f} |")
    if results and "step_baseline_s" in results[0]:
        lines += ["", "The same calls on the --baseline build, in the same rounds (microseconds; "
                  "baseline / this build):", "",
                  "| threads | rows | " + " | ".join(f"{op} baseline | this | ratio" for op in OPS)
                  + " |", "|---|---|" + "---|---|---|" * len(OPS)]
        for r in results:
            cells = []
            for op in OPS:
                a, b = r[f"{op}_baseline_s"] * 1e6, r[f"{op}_native_s"] * 1e6
                cells += [f"{a:.1f}", f"{b:.1f}", f"x{a / b:.2f}"]
            lines.append(f"| {r['threads']} | {r['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _baseline_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", type=Path, metavar="SO",
                        help="another build of the native kernels, every native call also run "
                             "on it in the same rounds (python -m bench.native_baseline --rev R "
                             "prints its path)")


def main() -> None:
    args = cpu_sweep.parse(__doc__, rows=[1, 8, 16, 64, 512, 2048], threads=[2], warmup=2,
                           repeats=15, out="results/cpu-ops", extra=_baseline_arg)
    baseline = None
    if args.baseline is not None:
        from bench.cpu_attention import load_baseline

        baseline = load_baseline(args.baseline)
        if not hasattr(baseline, "hadamard_heads"):
            raise SystemExit(f"--baseline {args.baseline} predates hadamard_heads (session 50); "
                             "build a later revision with python -m bench.native_baseline")
    results = cpu_sweep.sweep(args, lambda *a, **kw: measure(*a, **kw, baseline=baseline))
    cpu_sweep.write(args.out, "cpu_ops", {"results": results}, markdown(results))


if __name__ == "__main__":
    main()
