"""Logical token capacity of `ragged uniform:<rho>` over stock `torch_native` at the same KV budget,
plus the share of prefill attention time spent scoring and sealing.

    python -m bench.capacity --ratio 0.3 --out results/capacity

Both servers get the same --mem-fraction-static, so SGLang profiles the same KV byte budget;
each reports its max_total_num_tokens. The physical limit of the ratio is 1/rho (less the
staging pool and the k >= 4 sink floor). Writes capacity.json and capacity.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

import torch

from sgl_ragged.attention_backend.metadata import RequestPlan
from sgl_ragged.attention_backend.torch_ref import request_forward
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.models.smollm2 import ensure_smollm2
from sgl_ragged.profile import uniform_profile
from sgl_ragged.scoring import SnapKVScorer
from sgl_ragged.testing.server import ServerProcess


def server_capacity(model: str, backend_args: list[str], mem_fraction: float) -> int:
    args = ["--model-path", model, "--device", "cpu", "--page-size", "64",
            "--mem-fraction-static", str(mem_fraction), *backend_args]
    with ServerProcess(args) as server:
        with urllib.request.urlopen(server.base_url + "/get_server_info", timeout=60) as resp:
            return int(json.loads(resp.read())["max_total_num_tokens"])


def sealing_share(ratio: float, chunk: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Median time of one layer's extend forward over a 1024-token chunk (SmolLM2 shapes), with
    and without the pages being sealed (sealing includes scoring and the row writes)."""
    P, H, G, D = 64, 3, 3, 64
    layout = RaggedLayout.from_profile(uniform_profile(ratio, 1, H), P, D, 2)
    storage = RaggedStorage(layout, chunk // P + 2, 4, torch.bfloat16, "cpu", SnapKVScorer())
    pages = torch.arange(1, chunk // P + 1)

    def plan(num_seal: int) -> RequestPlan:
        return RequestPlan(q_start=0, prefix=0, seq_len=chunk, tail_start=0,
                           sealed_pages=torch.empty(0, dtype=torch.long),
                           prior_stages=torch.empty(0, dtype=torch.long), tail_pages=pages,
                           num_seal=num_seal, after_stages=torch.arange(len(pages) - num_seal),
                           tail_obs=torch.full((chunk,), 32.0), obs_queries=32)

    q = torch.randn(chunk, H * G, D, dtype=torch.bfloat16)
    k = torch.randn(chunk, H, D, dtype=torch.bfloat16)
    v = torch.randn(chunk, H, D, dtype=torch.bfloat16)
    storage.stage_k[0] = torch.zeros(len(pages), P, H, D, dtype=torch.bfloat16)
    storage.stage_v[0] = torch.zeros(len(pages), P, H, D, dtype=torch.bfloat16)
    storage.stage_attn = torch.zeros(len(pages), 1, H, P)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--mem-fraction-static", type=float, default=0.3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("results/capacity"))
    args = parser.parse_args()
    model = args.model or str(ensure_smollm2())
    print(f"[1/3] torch_native at mem-fraction {args.mem_fraction_static} ...", flush=True)
    base = server_capacity(model, ["--attention-backend", "torch_native"], args.mem_fraction_static)
    print(f"[2/3] ragged uniform:{args.ratio} ...", flush=True)
    ragged = server_capacity(model, ["--attention-backend", "ragged", "--ragged-profile",
                                     f"uniform:{args.ratio}"], args.mem_fraction_static)
    print("[3/3] sealing share of prefill attention ...", flush=True)
    share = sealing_share(args.ratio)
    result = {"ratio": args.ratio, "torch_native_tokens": base, "ragged_tokens": ragged,
              "capacity_ratio": ragged / base, "limit": 1 / args.ratio, **share}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity.json").write_text(json.dumps(result, indent=2))
    table = "\n".join([
        "| backend | logical tokens | ratio | limit 1/rho |", "|---|---|---|---|",
        f"| torch_native | {base} | 1.00 | |",
        f"| ragged uniform:{args.ratio} | {ragged} | {ragged / base:.2f} | {1 / args.ratio:.2f} |",
        "", f"Sealing (scoring + row writes) share of one layer's 1024-token extend: "
        f"{share['sealing_share']:.1%} (median {share['extend_with_sealing_s'] * 1e3:.1f} ms with, "
        f"{share['extend_without_sealing_s'] * 1e3:.1f} ms without)",
    ])
    (args.out / "capacity.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
