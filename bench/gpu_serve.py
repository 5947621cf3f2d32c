"""The mission's command on a GPU: SGLang serving a random-weight checkpoint of a real model's
shape with `--attention-backend ragged`, decode CUDA graphs on, checked against the same server
with them off (`--cuda-graph-backend-decode disabled`: the same greedy outputs), both with
`--ragged-check-integrity 1` (prefill CUDA graphs off in both: the decode graphs are what
attention_backend/graph.py captures).

    python -m bench.gpu_serve --model /tmp/llama-8b [--profile uniform:0.3] [--precision int4] \
        --out results/gpu_serve

scripts/gpu_serve.sh runs it on a lent GPU machine after installing SGLang from carried wheels
and sgl_kernel's stand-in (docs/gpu_serving.md). Each server answers two rounds of greedy
/generate requests sent together (round 2 extends every round-1 prompt with its answer and new
text: radix reuse and sealing across turns). Writes gpu_serve.json and gpu_serve.md; exits 1 when
a server fails to start, a request fails, the outputs differ or a server logs a traceback.
Needs CUDA; exits 0 without it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.accuracy_client import post
from bench.servers import GPU_ARGS, GPU_ENV  # what a server needs on the lent GPU machine
from sgl_ragged.testing.server import ServerError, ServerProcess

GRAPHS = {"decode graphs on": [], "decode graphs off": ["--cuda-graph-backend-decode", "disabled"]}
LOG_MARKERS = ("ragged attention:", "Ragged KV cache:", "decode split kernel:", "Capture cuda graph")


def prompts(n: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    """Random printable text (the byte-level tokenizer: one token per character)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     .,"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(min_chars, max_chars)))
            for _ in range(n)]


def generate(base_url: str, text: str, max_new_tokens: int) -> str:
    """Greedy completion of `text` through /generate."""
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    return post(base_url, body, timeout=600)["text"]


def serve_rounds(server: ServerProcess, first: list[str], follow: list[str],
                 max_new_tokens: int) -> dict:
    """Both rounds' outputs and seconds (each round's requests sent at once)."""
    result = {}
    with ThreadPoolExecutor(len(first)) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(lambda p: generate(server.base_url, p, max_new_tokens), first))
        result["round1_s"] = time.perf_counter() - t0
        second = [p + a + f for p, a, f in zip(first, answers, follow, strict=True)]
        t0 = time.perf_counter()
        result["round2"] = list(pool.map(lambda p: generate(server.base_url, p, max_new_tokens),
                                         second))
        result["round2_s"] = time.perf_counter() - t0
    result["round1"] = answers
    return result


def run_server(name: str, args: list[str], out: Path, first: list[str], follow: list[str],
               max_new_tokens: int) -> dict:
    """Start one server, serve both rounds, stop it; its row (and what its log says)."""
    print(f"{name}: starting ...", flush=True)
    server = ServerProcess(args, env=GPU_ENV, log_path=out / f"server-{name.replace(' ', '-')}.log",
                           startup_timeout=1200)
    row = {"name": name, "args": args}
    try:
        server.start()
        row["startup_s"] = server.startup_seconds
        row.update(serve_rounds(server, first, follow, max_new_tokens))
        print(f"{name}: up in {server.startup_seconds:.0f} s, round 1 {row['round1_s']:.1f} s, "
              f"round 2 {row['round2_s']:.1f} s", flush=True)
    except (ServerError, OSError) as exc:
        row["error"] = str(exc)[-2000:]
        print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
    finally:
        server.stop()
    log = server.log_text()
    row["log_lines"] = [line for line in log.splitlines() if any(m in line for m in LOG_MARKERS)]
    row["tracebacks"] = log.count("Traceback (most recent call last)")
    return row


def markdown(report: dict) -> str:
    lines = [f"SGLang with --attention-backend ragged on {report['device']} "
             f"({report['model']}, {report['profile']}, {report['precision']}): "
             f"{report['requests']} requests x 2 rounds, {report['max_new_tokens']} greedy tokens.", "",
             "| server | startup s | round 1 s | round 2 s | tracebacks | error |",
             "|---|---|---|---|---|---|"]
    for r in report["servers"]:
        lines.append(f"| {r['name']} | {r.get('startup_s') or 0:.0f} | {r.get('round1_s', 0):.1f} "
                     f"| {r.get('round2_s', 0):.1f} | {r['tracebacks']} | {r.get('error', '')[:80]} |")
    lines += ["", f"Same greedy outputs, graphs on vs off: {report['same_outputs']} "
              f"({report['matching']} of {2 * report['requests']})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint path (sgl_ragged.testing.tiny_model)")
    parser.add_argument("--profile", default="uniform:0.3")
    parser.add_argument("--precision", default="int4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=16,
                        help="decode batch sizes captured (fewer captures: a faster start)")
    parser.add_argument("--out", type=Path, default=Path("results/gpu_serve"))
    parser.add_argument("extra", nargs="*", help="more launch_server arguments (after --)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_serve.py needs a CUDA device; nothing run.")
        sys.exit(0)
    args.out.mkdir(parents=True, exist_ok=True)
    first = prompts(args.requests, 0, 200, 3000)
    follow = prompts(args.requests, 1, 20, 200)
    common = ["--model-path", args.model, "--attention-backend", "ragged", "--ragged-profile",
              args.profile, "--ragged-precision", args.precision, "--ragged-check-integrity", "1",
              *GPU_ARGS, "--cuda-graph-max-bs-decode", str(args.cuda_graph_max_bs), *args.extra]
    rows = [run_server(name, common + flags, args.out, first, follow, args.max_new_tokens)
            for name, flags in GRAPHS.items()]
    outputs = [r.get("round1", []) + r.get("round2", []) for r in rows]
    matching = sum(a == b for a, b in zip(*outputs, strict=False)) if all(outputs) else 0
    report = {"device": torch.cuda.get_device_name(), "model": args.model, "profile": args.profile,
              "precision": args.precision, "requests": args.requests,
              "max_new_tokens": args.max_new_tokens, "servers": rows, "matching": matching,
              "same_outputs": bool(all(outputs)) and matching == 2 * args.requests}
    (args.out / "gpu_serve.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "gpu_serve.md").write_text(table)
    print(table)
    for r in rows:
        print(f"{r['name']} log:", *r["log_lines"][:12], sep="\n  ")
    ok = report["same_outputs"] and not any(r["tracebacks"] or "error" in r for r in rows)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
