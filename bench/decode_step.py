"""Where the ragged backend's part of a CPU decode step goes: planning, and each layer's staging,
attention kernel and tail statistics, timed apart.

    python -m bench.decode_step [--batch 1 8 16 32] [--context 2048] --out results/decode-step
    python -m bench.decode_step --profile calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json \
        --precision bf16
    python -m bench.decode_step --baseline $(python -m bench.native_baseline --rev main | tail -1)

A decode step of `batch` requests, each with `context` tokens in sealed pages and 37 staged
tokens in its last page (one page staged: --ragged-window-pages 1, observation window 32), on
a storage whose bookkeeping (sealed pages, staging pages, req_to_token) is what a server's is
after the prefill, with random rows. Each round runs what the backend runs for one forward
(attention_backend/backend.py and native_impl.py), timing:

    | step     | what                                                                       |
    |----------|----------------------------------------------------------------------------|
    | plan     | planner.plan_batch and take_staging (once per forward)                     |
    | prepare  | NativeAttention.prepare: the kernels' tables and the tails' (once)         |
    | rotate   | with --rotation hadamard, every layer's HeadRotations: q, k and v rotated  |
    |          | before staging, the output rotated back after the kernel (RaggedAttention) |
    | stage    | every layer's NativeAttention.stage: the new token into its staging slots, |
    |          | the tail pages read back for the kernels                                   |
    | attend   | every layer's kernel call (NativeAttention.attend)                          |
    | store    | every layer's NativeAttention.store: window statistics and their staging   |

`--rotation hadamard` stores the rows rotated as the server does (`--ragged-rotation hadamard`:
on the CPU one native Hadamard transform per tensor, `hadamard_heads`); `hadamard-dense` rotates
by the dense matrices instead (one batched product per tensor, the GPU's form); several values
run each case with each. Steps are timed in order within a round (each needs the previous one's
output); medians over the repeats after warm-up, the model's dense layers excluded. The same
token is staged every round, so the storage's state is the same at every round. With `--baseline SO` (another build of
cuda_ext/, `python -m bench.native_baseline --rev R`) the same case also runs on that build's
kernels, its rounds alternating with this build's on the same storage (which runs first swaps
every round), and the table adds baseline / current per step: the kernels' functions (staging
copies, the attention, the window statistics) are the baseline's, everything else (the planner,
`prepare`, the storage's own native calls) is this tree's in both. Needs the native kernels (the
CPU server's path). Writes decode_step.json and decode_step.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from bench import cpu_sweep
from bench.cpu_attention import DEFAULT_PROFILE as DROP_PROFILE
from bench.cpu_attention import PAGE, TAIL, baseline_module, build_case, load_baseline
from sgl_ragged import native
from sgl_ragged.attention_backend.native_impl import NativeAttention
from sgl_ragged.attention_backend.planner import plan_batch, take_staging
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import BudgetProfile
from sgl_ragged.rotation import ROTATIONS, HeadRotations, Rotation

DEFAULT_PROFILE = Path("calib_profiles/smollm2-135m-instruct/mixed-uniform-rho0.3.json")
STEPS = ("plan", "prepare", "rotate", "stage", "attend", "store")
DENSE_ROTATION = "hadamard-dense"  # --rotation: the rotation by dense matrices (the GPU's form)
WINDOW_PAGES, OBS_WINDOW = 1, 32  # RaggedConfig's defaults


def served_case(profile: BudgetProfile, batch: int, context: int, precision: str,
                ) -> tuple[RaggedStorage, torch.Tensor, tuple[torch.Tensor, ...]]:
    """bench.cpu_attention's decode case with a server's bookkeeping: request b's sealed
    pages marked sealed, its tail page staged, its positions in row b of req_to_token."""
    storage, plans, qkv = build_case(profile, batch, context, True, precision)
    req_to_token = torch.zeros(batch, context + TAIL + 1, dtype=torch.int32)
    for b, plan in enumerate(plans):
        storage.sealed[plan.sealed_pages] = True
        for page in plan.tail_pages.tolist():
            storage.stage(page)
        pages = torch.cat([plan.sealed_pages, plan.tail_pages])
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        req_to_token[b] = slots[: req_to_token.shape[1]].to(torch.int32)
    return storage, req_to_token, qkv


def step_seconds(impl: NativeAttention, req_to_token: torch.Tensor, context: int,
                 qkv: tuple[torch.Tensor, ...], scale: float,
                 rotations: HeadRotations | None = None) -> dict[str, float]:
    """One decode forward, each step's seconds (layers summed); with `rotations` the rows are
    rotated as RaggedAttention.forward rotates them (the "rotate" step)."""
    storage, (q, k, v) = impl.storage, qkv
    batch = req_to_token.shape[0]
    prefix = context + TAIL
    seconds = dict.fromkeys(STEPS, 0.0)
    t0 = time.perf_counter()
    plan = take_staging(storage, plan_batch(req_to_token, storage, list(range(batch)),
                                            [prefix] * batch, [prefix + 1] * batch,
                                            WINDOW_PAGES, OBS_WINDOW))
    t1 = time.perf_counter()
    prepared = impl.prepare(plan)
    t2 = time.perf_counter()
    seconds["plan"], seconds["prepare"] = t1 - t0, t2 - t1
    for layer in range(storage.layout.num_layers):
        t0 = time.perf_counter()
        q_l, k_l, v_l = q, k, v
        if rotations is not None:
            q_l, k_l, v_l = (rotations.rotate(x, layer) for x in (q, k, v))
        t1 = time.perf_counter()
        k_pages, v_pages = impl.stage(layer, prepared, k_l, v_l)
        t2 = time.perf_counter()
        out, lse = impl.attend(layer, prepared, q_l, k_pages, v_pages, scale)
        t3 = time.perf_counter()
        if rotations is not None:
            rotations.restore(out, layer)
        t4 = time.perf_counter()
        impl.store(layer, prepared, q_l, k_pages, v_pages, lse, scale)
        t5 = time.perf_counter()
        if rotations is not None:
            seconds["rotate"] += (t1 - t0) + (t4 - t3)
        seconds["stage"] += t2 - t1
        seconds["attend"] += t3 - t2
        seconds["store"] += t5 - t4
    return seconds


def measure(profile: BudgetProfile, batch: int, context: int, precision: str, warmup: int,
            repeats: int, baseline: ModuleType | None = None,
            rotation: str = ROTATIONS[0]) -> list[dict]:
    """This build's row of the case, and with `baseline` the baseline build's, their rounds
    alternating (the order swapped every round)."""
    storage, req_to_token, qkv = served_case(profile, batch, context, precision)
    rotations = None
    if rotation != ROTATIONS[0]:
        layout = storage.layout
        rotations = HeadRotations(Rotation(layout.head_dim), range(layout.num_layers),
                                  range(sum(len(g) for g in layout.groups[0])),
                                  native=rotation != DENSE_ROTATION)
    impls = {"current": NativeAttention(storage)}
    module = baseline_module(baseline, storage)
    if baseline is not None and module is None:
        raise SystemExit(f"the baseline build cannot read {precision} rows (a quantized high "
                         "tier: it predates them)")
    if module is not None:
        impls["baseline"] = NativeAttention(storage, module=module)
    scale = profile.model.head_dim**-0.5
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in impls}
    for i in range(warmup + repeats):
        for name in cpu_sweep.round_order(impls, i):
            seconds = step_seconds(impls[name], req_to_token, context, qkv, scale, rotations)
            if i >= warmup:
                samples[name].append(seconds)
    results = []
    for name, runs in samples.items():
        result = {"batch": batch, "context": context, "precision": precision, "build": name,
                  "rotation": rotation, "layers": storage.layout.num_layers}
        for step in STEPS:
            result[f"{step}_s"] = statistics.median(s[step] for s in runs)
        result["total_s"] = statistics.median(sum(s.values()) for s in runs)
        results.append(result)
    return results


def markdown(results: list[dict], profile_name: str) -> str:
    lines = [f"The ragged backend's part of a CPU decode step ({profile_name}; "
             f"{torch.get_num_threads()} threads), medians in ms (stage, attend and store summed "
             "over the layers); outside: everything but the kernel, per layer in us.", "",
             "| batch | context | rows | rotation | build | plan | prepare | rotate | stage | attend | "
             "store | total | outside the kernel | per layer (us) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        outside = r["total_s"] - r["attend_s"]
        cells = [f"{1e3 * r[f'{name}_s']:.2f}" for name in STEPS]
        lines.append(f"| {r['batch']} | {r['context']} | {r['precision']} | "
                     f"{r.get('rotation', ROTATIONS[0])} | {r['build']} | "
                     f"{' | '.join(cells)} | {1e3 * r['total_s']:.2f} | "
                     f"{100 * outside / r['total_s']:.0f}% | {1e6 * outside / r['layers']:.0f} |")
    pairs = [(c, b) for c, b in zip(results, results[1:], strict=False)
             if c["build"] == "current" and b["build"] == "baseline"]
    if pairs:
        lines += ["", "Baseline / current (above 1: this build is faster), the same rounds:", "",
                  "| batch | context | " + " | ".join(STEPS) + " | total | outside the kernel |",
                  "|---|---|" + "---|" * (len(STEPS) + 2)]
        for c, b in pairs:
            ratios = [(b[f"{s}_s"], c[f"{s}_s"]) for s in (*STEPS, "total")]
            outside = (b["total_s"] - b["attend_s"], c["total_s"] - c["attend_s"])
            lines.append(f"| {c['batch']} | {c['context']} | "
                         + " | ".join(f"x{x / y:.2f}" if y else "-" for x, y in (*ratios, outside))
                         + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--precision", default="mixed",
                        help="the rows' precision (--ragged-precision; mixed: the profile's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[2048])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline", type=Path, default=None, metavar="SO",
                        help="another build of the kernels to time in the same rounds "
                             "(python -m bench.native_baseline --rev R prints its path)")
    parser.add_argument("--rotation", choices=(*ROTATIONS, DENSE_ROTATION), nargs="+",
                        default=[ROTATIONS[0]],
                        help="store the rows rotated (hadamard: --ragged-rotation hadamard, "
                             f"native; {DENSE_ROTATION}: by dense matrices) and time the "
                             "rotations; several: each case with each")
    parser.add_argument("--out", type=Path, default=Path("results/decode-step"))
    args = parser.parse_args()
    if min(args.batch) < 1 or min(args.context) < PAGE or args.repeats < 1 or args.warmup < 0:
        parser.error(f"--batch and --repeats must be at least 1, --context at least {PAGE} "
                     "and --warmup at least 0")
    if args.precision == "mixed" and args.profile == DROP_PROFILE:
        parser.error("--precision mixed needs a profile with per-head precision (the default "
                     f"{DEFAULT_PROFILE})")
    if not native.available():
        raise SystemExit(f"bench.decode_step times the native kernels' path: {native.reason()}")
    native.load()
    baseline = load_baseline(args.baseline) if args.baseline else None
    profile = BudgetProfile.load(args.profile)
    cases = [(b, c, r) for c in args.context for b in args.batch for r in args.rotation]
    results = []
    for i, (batch, context, rotation) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] batch {batch}, context {context}, rotation {rotation} ...",
              flush=True)
        results += measure(profile, batch, context, args.precision, args.warmup, args.repeats,
                           baseline, rotation)
    cpu_sweep.write(args.out, "decode_step", {"profile": str(args.profile),
                                              "baseline": str(args.baseline or ""),
                                              "results": results},
                    markdown(results, args.profile.name))


if __name__ == "__main__":
    main()
