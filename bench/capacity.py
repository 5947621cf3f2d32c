"""Logical token capacity of `ragged <profile>` over stock `torch_native` at the same KV budget,
plus the share of prefill attention time spent scoring and sealing.

    python -m bench.capacity --profile uniform:0.3 --out results/capacity
    python -m bench.capacity --launch ragged@mixed:calib_profiles/smollm2-135m-instruct/mixed-uniform-rho0.3.json

Every server gets the same --mem-fraction-static, so SGLang profiles the same KV byte budget;
each reports its max_total_num_tokens. `--profile SPEC` serves a profile's rows at the model
dtype (drop-only); `--launch ragged@<precision>:<profile>` (bench.multiturn's syntax,
bench.servers.Target) adds --ragged-precision, for row tiers and per-head precision. The
physical limit of a configuration is 1/retention of its layout (1/rho for uniform:<rho> rows),
less the staging pool and the k >= 4 sink floor. Writes capacity.json and capacity.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path

import torch

from bench.servers import Target
from sgl_ragged.attention_backend.plan import RequestPlan
from sgl_ragged.attention_backend.torch_ref import request_forward
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.models.smollm2 import ensure_smollm2
from sgl_ragged.profile import uniform_profile
from sgl_ragged.scoring import SnapKVScorer
from sgl_ragged.testing.server import ServerProcess


def server_capacity(model: str, backend_args: list[str], mem_fraction: float) -> tuple[int, float]:
    """(max_total_num_tokens, KV bytes budget in GB the server sized its pool from)."""
    args = ["--model-path", model, "--device", "cpu", "--page-size", "64",
            "--mem-fraction-static", str(mem_fraction), *backend_args]
    with ServerProcess(args) as server:
        with urllib.request.urlopen(server.base_url + "/get_server_info", timeout=60) as resp:
            tokens = int(json.loads(resp.read())["max_total_num_tokens"])
        return tokens, kv_budget_gb(server.log_text())


def kv_budget_gb(log: str) -> float:
    """The KV budget a server's log reports: ragged's "logical pages from X GB", or stock
    SGLang's "K size: x GB, V size: y GB" (rounded to 0.01 GB by SGLang)."""
    ragged = re.search(r"ragged capacity: \d+ logical pages from ([\d.]+) GB", log)
    if ragged:
        return float(ragged.group(1))
    stock = re.search(r"K size: ([\d.]+) GB, V size: ([\d.]+) GB", log)
    return float(stock.group(1)) + float(stock.group(2)) if stock else float("nan")


def sealing_share(ratio: float, chunk: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Median time of one layer's extend forward over a 1024-token chunk (SmolLM2 shapes), with
    and without the pages being sealed (sealing includes scoring and the row writes)."""
    P, H, G, D = 64, 3, 3, 64
    layout = RaggedLayout.from_profile(uniform_profile(ratio, 1, H), P, D, 2)
    pages = torch.arange(1, chunk // P + 1)
    storage = RaggedStorage(layout, chunk // P + 2, len(pages), torch.bfloat16, "cpu", SnapKVScorer())

    def plan(num_seal: int) -> RequestPlan:
        return RequestPlan(q_start=0, prefix=0, seq_len=chunk, tail_start=0,
                           sealed_pages=torch.empty(0, dtype=torch.long),
                           prior_stages=torch.empty(0, dtype=torch.long), tail_pages=pages,
                           num_seal=num_seal, after_stages=torch.arange(len(pages) - num_seal),
                           tail_obs=torch.full((chunk,), 32.0), obs_queries=32)

    q = torch.randn(chunk, H * G, D, dtype=torch.bfloat16)
    k = torch.randn(chunk, H, D, dtype=torch.bfloat16)
    v = torch.randn(chunk, H, D, dtype=torch.bfloat16)

    def timed(p: RequestPlan) -> float:
        samples = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            request_forward(storage, 0, p, q, k, v, D**-0.5)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])  # first run is warm-up

    seal_all, seal_none = timed(plan(len(pages))), timed(plan(0))
    return {"extend_with_sealing_s": seal_all, "extend_without_sealing_s": seal_none,
            "sealing_share": max(0.0, seal_all - seal_none) / seal_all}


def physical_limit(spec: str, model: str, precision: str = "bf16") -> float:
    """1 / retention of the profile's layout (rows at `precision`) at page size 64 (what the
    bytes allow)."""
    from sgl_ragged.profile import model_shape, resolve_profile

    shape = model_shape(model)
    layout = RaggedLayout.from_profile(resolve_profile(spec, shape), 64, shape.head_dim, 2,
                                       precision)
    return 1 / layout.retention


def targets_of(profiles: list[str] | None, launches: list[str] | None) -> list[Target]:
    """The ragged configurations to start: each --profile at the model dtype, then each
    --launch (ragged@<precision>:<profile>); uniform:0.3 when neither is given."""
    targets = [Target(f"ragged:{spec}", spec) for spec in profiles or []]
    for spec in launches or []:
        target = Target.parse(spec)
        if target.profile is None or target.workers > 1 or target.policy:
            raise ValueError(f"--launch {spec!r}: bench.capacity starts single ragged servers: "
                             "ragged:<profile> or ragged@<precision>:<profile>")
        targets.append(target)
    return targets or [Target("ragged:uniform:0.3", "uniform:0.3")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=None,
                        help="ragged profile spec or file, rows at the model dtype (repeatable; "
                        "default uniform:0.3 when no --launch is given either)")
    parser.add_argument("--launch", action="append", default=None,
                        help="ragged@<precision>:<profile> (bench.multiturn's syntax): a profile "
                        "served with --ragged-precision (repeatable)")
    parser.add_argument("--seal-ratio", type=float, default=0.3, help="rho of the sealing microbench")
    parser.add_argument("--mem-fraction-static", type=float, default=0.3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("results/capacity"))
    args = parser.parse_args()
    try:
        targets = targets_of(args.profile, args.launch)
    except ValueError as err:
        parser.error(str(err))
    model = args.model or str(ensure_smollm2())
    steps = len(targets) + 2
    print(f"[1/{steps}] torch_native at mem-fraction {args.mem_fraction_static} ...", flush=True)
    base, base_gb = server_capacity(model, ["--attention-backend", "torch_native"],
                                    args.mem_fraction_static)
    rows = []
    for i, target in enumerate(targets, start=2):
        print(f"[{i}/{steps}] {target.label} ...", flush=True)
        tokens, gb = server_capacity(model, ["--attention-backend", "ragged", "--ragged-profile",
                                             target.profile, "--ragged-precision",
                                             target.precision], args.mem_fraction_static)
        rows.append({"profile": target.profile, "precision": target.precision,
                     "ragged_tokens": tokens, "kv_budget_gb": gb, "capacity_ratio": tokens / base,
                     "limit": physical_limit(target.profile, model, target.precision)})
    print(f"[{steps}/{steps}] sealing share of prefill attention ...", flush=True)
    share = sealing_share(args.seal_ratio)
    result = {"torch_native_tokens": base, "torch_native_kv_budget_gb": base_gb,
              "mem_fraction_static": args.mem_fraction_static,
              "profiles": rows, "seal_ratio": args.seal_ratio, **share}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity.json").write_text(json.dumps(result, indent=2))
    lines = ["| backend | KV budget (GB) | logical tokens | ratio | physical limit (1/retention) |",
             "|---|---|---|---|---|", f"| torch_native | {base_gb:.2f} | {base} | 1.00 | |"]
    lines += [f"| ragged {r['profile']} ({r['precision']}) | {r['kv_budget_gb']:.2f} | "
              f"{r['ragged_tokens']} | {r['capacity_ratio']:.2f} | {r['limit']:.2f} |"
              for r in rows]
    lines += ["", "The budget is what SGLang's memory profiling found free at each start (the same "
              "--mem-fraction-static); run on a quiet machine, or the budgets differ."]
    lines += ["", f"Sealing (scoring + row writes) share of one layer's 1024-token extend at rho "
              f"{args.seal_ratio}: {share['sealing_share']:.1%} (median "
              f"{share['extend_with_sealing_s'] * 1e3:.1f} ms with, "
              f"{share['extend_without_sealing_s'] * 1e3:.1f} ms without)"]
    table = "\n".join(lines)
    (args.out / "capacity.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
