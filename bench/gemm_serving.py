"""Decode and prefill speed of one served configuration under each RAGGED_CPU_GEMM choice.

    python -m bench.gemm_serving [--choices bfloat16 auto] [--ops auto] [--concurrency 1 8 16] \
        [--prefill-tokens 2048] --out results/gemm-serving

For every choice (compat/cpu_gemm.CHOICES: how a CPU server multiplies its bfloat16 dense layers
and lm_head), and with more than one --ops every pair of a choice and a RAGGED_CPU_OPS value
(compat/cpu_ops.CHOICES: RMSNorm and the rotary embedding native or torch; labelled
`choice ops=value`), the same server is started (default: the README's, SmolLM2-135M with
`--attention-backend ragged` and the default profile and precision), warmed up, and sent rounds
of `c` concurrent chat requests with distinct short prompts whose answers run to exactly
--max-tokens tokens (`min_tokens`), greedy. A round's decode rate is its output tokens over its
wall time; TPOT is each request's time per output token after the first. Every configuration's
server is alive at once (idle ones sleep, `--sleep-on-idle`) and the rounds alternate over them,
the order of the configurations reversed every other round (`cpu_sweep.round_order`: a fixed
order biased a served A/B by up to 14%), and within a configuration's turn over the
concurrencies; medians over --repeats rounds after --warmup. Then, with --prefill-tokens N (0:
none), rounds of one request per configuration, alternating the same way, whose prompt is a
distinct document of about N tokens (distinct from its first words, so the radix cache holds
nothing of it but the chat template's system prompt) and a 2-token answer: the prefill rate is
its prompt tokens (as the server counts them, less those it had cached) over its time to first
token. Ratios are against the first choice; without --choices, the route `auto`
replaces on this CPU (`default_choices`) and `auto`. Writes gemm_serving.json and
gemm_serving.md; each server's log beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import cpu_sweep
from bench.client import RequestRecord, chat_payload, stream_chat
from sgl_ragged import native
from sgl_ragged.compat import cpu_ops
from sgl_ragged.compat.cpu_gemm import CHOICES
from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE

TIMEOUT = aiohttp.ClientTimeout(total=1800)  # one round: a decode round or a prefill

TOPICS = ("a lighthouse", "the moon", "a violin", "rain in a city", "an old map", "a robot cook",
          "a mountain pass", "the first snow", "a desert well", "a paper boat", "a night train",
          "a clock tower", "a fox", "the sea in winter", "a library", "a garden at dawn")


def launch_args(model: str, args: argparse.Namespace) -> list[str]:
    served = (["--attention-backend", "ragged", "--ragged-profile", args.profile,
               "--ragged-precision", args.precision] if args.profile
              else ["--attention-backend", "torch_native"])
    return ["--model-path", model, "--device", "cpu", *served,
            "--max-total-tokens", str(args.max_total_tokens),
            "--max-running-requests", str(max(args.concurrency)), "--page-size",
            str(args.page_size), "--chunked-prefill-size", str(args.chunked_prefill_size),
            "--enable-cache-report"]


async def one_round(base_url: str, concurrency: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """`concurrency` requests at once; their decode rate and TPOTs."""
    records = [RequestRecord(session=i, turn=0, task="story", start=0.0)
               for i in range(concurrency)]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(
            stream_chat(http, base_url, _payload(seed, i, max_tokens), record, t0)
            for i, record in enumerate(records)))
        wall = time.perf_counter() - t0
    errors = [r.error for r in done if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {concurrency} requests failed: {errors[0]}")
    tokens = sum(r.output_tokens for r in done)
    tpots = [r.tpot for r in done if r.tpot is not None]
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "tpot_s": statistics.median(tpots) if tpots else None}


def _payload(seed: int, i: int, max_tokens: int) -> dict[str, Any]:
    topic = TOPICS[(seed + i) % len(TOPICS)]
    payload = chat_payload([{"role": "user", "content": f"Tell a short story about {topic}. "
                             f"(request {seed}-{i})"}], max_tokens)
    payload["min_tokens"] = max_tokens
    return payload


WORDS = ("river", "stone", "window", "quiet", "market", "yellow", "engine", "garden", "winter",
         "letter", "bridge", "candle", "forest", "silver", "harbor", "pocket", "thunder", "basket",
         "mirror", "orchard", "ladder", "copper", "meadow", "signal", "lantern", "valley")


def document(seed: int, tokens: int) -> str:
    """About `tokens` tokens of filler (a word with its leading space is one token in SmolLM2's
    tokenizer, a full stop every 12 words one more), distinct per seed from the first words on."""
    words, x = [f"Document {seed}:"], seed * 2654435761 + 1
    for i in range(max(tokens * 12 // 13, 1)):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        words.append(WORDS[(x >> 33) % len(WORDS)] + ("." if i % 12 == 11 else ""))
    return " ".join(words)


async def prefill_round(base_url: str, tokens: int, seed: int) -> dict[str, Any]:
    """One request with a fresh document of about `tokens` tokens: its prefill rate."""
    record = RequestRecord(session=0, turn=0, task="prefill", start=0.0)
    payload = chat_payload([{"role": "user", "content": document(seed, tokens)
                             + "\nName the document's first word."}], 2)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        await stream_chat(http, base_url, payload, record, time.perf_counter())
    if record.error or record.ttft is None:
        raise RuntimeError(f"the prefill request failed: {record.error or 'no token came back'}")
    fresh = record.prompt_tokens - record.cached_tokens
    return {"prompt_tokens": record.prompt_tokens, "cached_tokens": record.cached_tokens,
            "ttft_s": record.ttft, "prefill_tok_s": fresh / record.ttft}


def measure_prefill(servers: dict[str, str], tokens: int, warmup: int,
                    repeats: int) -> dict[str, dict[str, float]]:
    """Per configuration (label -> base URL), the median prefill rate and TTFT over `repeats`
    rounds after `warmup`; a round prefills a new document on every server, in
    `cpu_sweep.round_order`."""
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
    for r in range(warmup + repeats):
        for label, url in cpu_sweep.round_order(servers.items(), r):
            result = asyncio.run(prefill_round(url, tokens, seed=1000 + r))
            if r >= warmup:
                rounds[label].append(result)
    return {label: {"prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in rs),
                    "ttft_s": statistics.median(x["ttft_s"] for x in rs),
                    "prompt_tokens": statistics.median(x["prompt_tokens"] for x in rs),
                    "cached_tokens": max(x["cached_tokens"] for x in rs), "rounds": len(rs)}
            for label, rs in rounds.items()}


def measure(servers: dict[str, str], concurrency: list[int], max_tokens: int, warmup: int,
            repeats: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per configuration (label -> base URL), the median tokens/s and TPOT per concurrency. A
    round visits every server in `cpu_sweep.round_order` (who goes first swaps every round), and
    on each runs the concurrencies in turn; the same prompts go to every server in a round."""
    rounds: dict[str, dict[int, list[dict[str, Any]]]] = {
        label: {c: [] for c in concurrency} for label in servers}
    total = warmup + repeats
    for r in range(total):
        for label, url in cpu_sweep.round_order(servers.items(), r):
            for c in concurrency:
                result = asyncio.run(one_round(url, c, max_tokens, seed=100 * r + c))
                if r >= warmup:
                    rounds[label][c].append(result)
        print(f"    round {r + 1}/{total} done", flush=True)
    return {label: {c: {"tok_s": statistics.median(x["tok_s"] for x in rs),
                        "tpot_s": statistics.median(x["tpot_s"] for x in rs
                                                    if x["tpot_s"] is not None),
                        "rounds": len(rs)} for c, rs in per_c.items()}
            for label, per_c in rounds.items()}


def markdown(report: dict[str, Any]) -> str:
    choices = list(report["choices"])
    first = choices[0]
    lines = [f"Decode of `{report['served']}` on the CPU per RAGGED_CPU_GEMM choice "
             "(ops=: RAGGED_CPU_OPS), "
             f"{report['max_tokens']}-token answers, medians of {report['repeats']} rounds; ratios "
             f"against {first}.", "",
             "| concurrency | " + " | ".join(f"{c} tok/s | {c} TPOT ms" for c in choices)
             + " | " + " | ".join(f"{c} / {first}" for c in choices[1:]) + " |",
             "|---|" + "---|---|" * len(choices) + "---|" * (len(choices) - 1)]
    for conc in report["concurrency"]:
        cells, base = [], report["choices"][first][str(conc)]["tok_s"]
        for c in choices:
            m = report["choices"][c][str(conc)]
            cells.append(f"{m['tok_s']:.1f} | {m['tpot_s'] * 1e3:.0f}")
        ratios = [f"x{report['choices'][c][str(conc)]['tok_s'] / base:.2f}" for c in choices[1:]]
        lines.append(f"| {conc} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    prefill = {c: report["choices"][c]["prefill"] for c in choices
               if report["choices"][c].get("prefill")}
    if prefill:
        base = prefill.get(first)
        lines += ["", "Prefill of a fresh document (chunks of the launch's "
                  f"--chunked-prefill-size), medians of {report['repeats']} rounds:", "",
                  f"| choice | prompt tokens | cached | TTFT ms | prefill tok/s | vs {first} |",
                  "|---|---|---|---|---|---|"]
        for c, m in prefill.items():
            ratio = f"x{m['prefill_tok_s'] / base['prefill_tok_s']:.2f}" if base else "-"
            lines.append(f"| {c} | {m['prompt_tokens']:.0f} | {m['cached_tokens']} | "
                         f"{m['ttft_s'] * 1e3:.0f} | {m['prefill_tok_s']:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def default_choices(flags: frozenset[str]) -> list[str]:
    """What `auto` replaces on a CPU with these flags, then `auto`: torch's bfloat16 product
    where the CPU multiplies bfloat16 (AVX512-BF16 or AMX), else session 23's float32 route."""
    fast_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    return ["bfloat16" if fast_bf16 else "float32", "auto"]


def configurations(choices: list[str], ops: list[str]) -> dict[str, dict[str, str]]:
    """Label -> server environment of every run: each RAGGED_CPU_GEMM choice, and with more than
    one RAGGED_CPU_OPS value each pair (`auto ops=torch`), in the order given."""
    return {(gemm if len(ops) == 1 else f"{gemm} ops={op}"):
            {"RAGGED_CPU_GEMM": gemm, "RAGGED_CPU_OPS": op} for gemm in choices for op in ops}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--choices", nargs="+", choices=list(CHOICES),
                   help="RAGGED_CPU_GEMM values, the first the reference (default: what auto "
                        "replaces on this CPU, then auto)")
    p.add_argument("--ops", nargs="+", default=["auto"], choices=list(cpu_ops.CHOICES),
                   help="RAGGED_CPU_OPS values, each run with every choice (default: auto)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=2048,
                   help="prompt length of the prefill rounds (0: no prefill rounds)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="the served profile (an empty string: stock torch_native)")
    p.add_argument("--precision", default=DEFAULT_PRECISION)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64,
                   help="the ragged backend's default, as scripts/serve.sh serves (before "
                        "session 34 this bench served pages of 16)")
    p.add_argument("--chunked-prefill-size", type=int, default=4096,
                   help="what SGLang 0.5.23 picks for scripts/serve.sh's CPU server (before "
                        "session 34 this bench served chunks of 512)")
    p.add_argument("--out", type=Path, default=Path("results/gemm-serving"))
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.repeats < 1 or args.max_tokens < 2 \
            or args.prefill_tokens < 0:
        p.error("--concurrency and --repeats must be at least 1, --max-tokens at least 2, "
                "--prefill-tokens at least 0")
    from bench.servers import start_all
    from sgl_ragged.models.smollm2 import ensure_smollm2

    server_args = launch_args(args.model or str(ensure_smollm2()), args)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "served": f"ragged {args.precision}:{args.profile}" if args.profile else "torch_native",
        "launch_args": server_args, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "concurrency": args.concurrency, "prefill_tokens": args.prefill_tokens, "choices": {}}
    runs = configurations(args.choices or default_choices(native.cpu_flags()), args.ops)
    with contextlib.ExitStack() as stack:
        urls = start_all(stack, server_args, [
            (" ".join(f"{k}={v}" for k, v in env.items()), env,
             args.out / f"server-{choice.replace(' ops=', '-ops-')}.log")
            for choice, env in runs.items()])
        servers = dict(zip(runs, urls, strict=True))
        print(f"measuring concurrency {args.concurrency}, {args.warmup} + {args.repeats} rounds "
              "alternating over the servers ...", flush=True)
        decode = measure(servers, args.concurrency, args.max_tokens, args.warmup, args.repeats)
        report["choices"] = {label: {str(c): m for c, m in per_c.items()}
                             for label, per_c in decode.items()}
        if args.prefill_tokens:
            print(f"measuring the prefill of {args.prefill_tokens}-token prompts ...", flush=True)
            for label, m in measure_prefill(servers, args.prefill_tokens, args.warmup,
                                            args.repeats).items():
                report["choices"][label]["prefill"] = m
    cpu_sweep.write(args.out, "gemm_serving", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
