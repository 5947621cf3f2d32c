"""The mission's command on a GPU: SGLang serving a random-weight checkpoint of a real model's
shape with `--attention-backend ragged`, decode CUDA graphs and SGLang's overlap scheduler on (as
it serves by default), checked against the same server with both off
(`--cuda-graph-backend-decode disabled --disable-overlap-schedule`: the same greedy outputs),
both with `--ragged-check-integrity 1` (prefill CUDA graphs off in both: the decode graphs are
what attention_backend/graph.py captures; under the overlap scheduler finish-time sealing queues
behind the forward in flight, RaggedStorage.follow_forward).

    python -m bench.gpu_serve --model /tmp/llama-8b [--profile uniform:0.3] [--precision int4] \
        --out results/gpu_serve

scripts/gpu_serve.sh runs it on a lent GPU machine after installing SGLang from carried wheels
and sgl_kernel's stand-in (docs/gpu_serving.md). Each server answers two rounds of greedy
/generate requests sent together (round 2 extends every round-1 prompt with its answer and new
text: radix reuse and sealing across turns). Every answer comes with each step's token
log-probability and top two: where two servers' answers part, the step's top-two gap in both says
whether it is a near tie (both gaps at most TIE nats, and each server's token the other's
second: random weights give near-flat logits, where a last-bit difference flips the argmax) or a
real difference; a round-2 answer is compared only where the round-1 answers agreed (its prompt
holds the answer). Writes gpu_serve.json and gpu_serve.md; exits 1 when a server fails to start,
a request fails, an answer parts from the other server's anywhere but at a near tie, the chosen
tokens' log-probabilities before a parting differ by more than TIE, or a server logs a
traceback. Needs CUDA; exits 0 without it.
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

SERVERS = {"graphs and overlap on": [],
           "both off": ["--cuda-graph-backend-decode", "disabled", "--disable-overlap-schedule"]}
LOG_MARKERS = ("ragged attention:", "Ragged KV cache:", "decode split kernel:", "Capture cuda graph")


def prompts(n: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    """Random printable text (the byte-level tokenizer: one token per character)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     .,"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(min_chars, max_chars)))
            for _ in range(n)]


TIE = 0.05
"""Nats: a top-two gap at most this is a near tie; the chosen tokens' log-probabilities of two
servers before their answers part may differ by at most this."""


def generate(base_url: str, text: str, max_new_tokens: int) -> dict:
    """Greedy completion of `text` through /generate: its text, and per step the token, its
    log-probability and the top two (token, log-probability)."""
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            "return_logprob": True, "top_logprobs_num": 2}
    out = post(base_url, body, timeout=600)
    meta = out["meta_info"]
    return {"text": out["text"],
            "tokens": [int(t) for _, t, *_ in meta["output_token_logprobs"]],
            "logprobs": [float(lp) for lp, *_ in meta["output_token_logprobs"]],
            "top2": [[(int(t), float(lp)) for lp, t, *_ in step]
                     for step in meta["output_top_logprobs"]]}


def serve_rounds(server: ServerProcess, first: list[str], follow: list[str],
                 max_new_tokens: int) -> dict:
    """Both rounds' answers (texts, and their steps) and seconds (each round's requests sent at
    once)."""
    result = {}
    with ThreadPoolExecutor(len(first)) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(lambda p: generate(server.base_url, p, max_new_tokens), first))
        result["round1_s"] = time.perf_counter() - t0
        second = [p + a["text"] + f for p, a, f in zip(first, answers, follow, strict=True)]
        t0 = time.perf_counter()
        seconds = list(pool.map(lambda p: generate(server.base_url, p, max_new_tokens), second))
        result["round2_s"] = time.perf_counter() - t0
    for name, got in (("round1", answers), ("round2", seconds)):
        result[name] = [a["text"] for a in got]
        result[f"{name}_steps"] = [{k: a[k] for k in ("tokens", "logprobs", "top2")} for a in got]
    return result


def parting(a: dict, b: dict) -> dict:
    """Where two greedy answers' steps (`generate`'s tokens, logprobs, top2) part, and whether
    that is a near tie; `drift`: the largest difference of the chosen tokens' log-probabilities
    before it."""
    ta, tb = a["tokens"], b["tokens"]
    at = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
    common = min(len(ta), len(tb)) if at is None else at
    before = zip(a["logprobs"][:common], b["logprobs"][:common], strict=True)
    drift = max((abs(x - y) for x, y in before), default=0.0)
    if at is None:
        same = len(ta) == len(tb)
        return {"same": same, "at": None if same else common, "near_tie": False, "drift": drift}

    def gap(top: list) -> float:
        return top[0][1] - top[1][1] if len(top) > 1 else float("inf")

    top_a, top_b = a["top2"][at], b["top2"][at]
    near = (max(gap(top_a), gap(top_b)) <= TIE and tb[at] in [t for t, _ in top_a]
            and ta[at] in [t for t, _ in top_b])
    return {"same": False, "at": at, "gaps": [gap(top_a), gap(top_b)], "near_tie": near,
            "drift": drift}


def compare(on: dict, off: dict) -> list[dict]:
    """Every comparable answer of two servers' rows: round 1, then round 2 where round 1 agreed."""
    rows = []
    for i, (a, b) in enumerate(zip(on["round1_steps"], off["round1_steps"], strict=True)):
        rows.append({"round": 1, "request": i, **parting(a, b)})
    for i, (a, b) in enumerate(zip(on["round2_steps"], off["round2_steps"], strict=True)):
        if rows[i]["same"]:
            rows.append({"round": 2, "request": i, **parting(a, b)})
    return rows


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
    lines += ["", f"Same greedy outputs, graphs and overlap on vs both off: {report['same_outputs']} "
              f"({report['matching']} of {2 * report['requests']})."]
    parts = report.get("partings")
    if parts is not None:
        apart = [p for p in parts if not p["same"]]
        near = sum(p["near_tie"] for p in apart)
        drift = max((p["drift"] for p in parts), default=0.0)
        lines.append(f"Compared answers: {len(parts)} ({len(parts) - len(apart)} the same); "
                     f"parted at a near tie (top-two gap <= {TIE} nats in both): {near}, "
                     f"elsewhere: {len(apart) - near}; largest difference of a chosen token's "
                     f"log-probability before parting: {drift:.4f}.")
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
            for name, flags in SERVERS.items()]
    outputs = [r.get("round1", []) + r.get("round2", []) for r in rows]
    matching = sum(a == b for a, b in zip(*outputs, strict=False)) if all(outputs) else 0
    answered = all("round2_steps" in r for r in rows)
    parts = compare(rows[0], rows[1]) if answered else None
    report = {"device": torch.cuda.get_device_name(), "model": args.model, "profile": args.profile,
              "precision": args.precision, "requests": args.requests,
              "max_new_tokens": args.max_new_tokens, "servers": rows, "matching": matching,
              "same_outputs": bool(all(outputs)) and matching == 2 * args.requests,
              "partings": parts}
    (args.out / "gpu_serve.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "gpu_serve.md").write_text(table)
    print(table)
    for r in rows:
        print(f"{r['name']} log:", *r["log_lines"][:12], sep="\n  ")
    agree = parts is not None and all((p["same"] or p["near_tie"]) and p["drift"] <= TIE
                                      for p in parts)
    ok = agree and not any(r["tracebacks"] or "error" in r for r in rows)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
