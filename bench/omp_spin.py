"""Decode speed of one served configuration under each OpenMP spin count (GOMP_SPINCOUNT).

    python -m bench.omp_spin [--spins 0 3000] [--concurrency 1 8 16] [--long-prompt 1900] \
        [--contention] --out results/omp-spin
    python -m bench.omp_spin --spins 3000:4194304 3000 ...   # the dots' split threshold too
    python -m bench.omp_spin --spins 3000/openmp 3000/pool@20 3000 ...   # the kernels' pool

scripts/env.sh has OpenMP's idle workers sleep at once (`OMP_WAIT_POLICY=PASSIVE`, spin count
0); scripts/serve.sh lets them spin GOMP_SPINCOUNT iterations first (libgomp reads it at start,
and an explicit count overrides the policy's). A decode step runs a parallel region per dense
layer and per attention call, so a worker woken for each pays a wake-up every time, while a
spinning one takes a core that another busy process may need. Per spin count one server
(default: the README's, SmolLM2-135M with the default profile and precision) is started, all of
them alive at once (idle ones sleep, `--sleep-on-idle`), and the rounds alternate over them:

- short: `c` concurrent chat requests with short prompts whose answers run to exactly
  --max-tokens tokens (`min_tokens`), greedy; the decode rate is output tokens over wall time;
- long (--long-prompt N > 0): --long-concurrency requests, each a fresh document of about N
  tokens, answered with --max-tokens tokens; the median TPOT (time per output token after the
  first) is the decode step of a batch attending to N-token contexts;
- contention (--contention): two servers per spin count, each sent a short round of the
  largest concurrency at the same moment; their summed output tokens over the longer wall
  time (what the spin costs when another busy process shares the cores).

A setting `SPIN:MACS` also sets RAGGED_DOT_SERIAL_MACS=MACS for its server (the native dots
keep calls below MACS products on one thread; unset, compat/cpu_gemm derives it from the spin
count); a trailing `/openmp`, `/pool` or `/pool@US` sets which pool splits the native kernels'
work (RAGGED_NATIVE_POOL) and the pool's spin in microseconds (RAGGED_POOL_SPIN_US). Medians
over --repeats rounds after --warmup, the settings' order reversed every other round; ratios
against the first setting. Writes omp_spin.json and omp_spin.md, and each
server's log beside them.
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
from bench.gemm_serving import TIMEOUT, document, one_round
from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE


def spin_setting(value: str) -> str:
    """A --spins value: SPIN or SPIN:MACS (whole numbers), optionally /openmp, /pool or
    /pool@US (argparse's type)."""
    counts, _, pool = value.partition("/")
    if not all(part.isdigit() for part in counts.split(":")) or counts.count(":") > 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not SPIN or SPIN:MACS (whole numbers), "
                                         "with an optional /openmp, /pool or /pool@US")
    kind, _, spin_us = pool.partition("@")
    if "/" in value and (kind not in ("openmp", "pool") or (spin_us and not spin_us.isdigit())
                         or (spin_us and kind != "pool")):
        raise argparse.ArgumentTypeError(f"{value!r}: after / comes openmp, pool or pool@US "
                                         "(the pool's spin in microseconds)")
    return value


def setting_env(setting: str) -> dict[str, str]:
    """The environment of a --spins setting's server."""
    counts, _, pool = setting.partition("/")
    spin, _, macs = counts.partition(":")
    kind, _, spin_us = pool.partition("@")
    return {"GOMP_SPINCOUNT": spin, **({"RAGGED_DOT_SERIAL_MACS": macs} if macs else {}),
            **({"RAGGED_NATIVE_POOL": kind} if kind else {}),
            **({"RAGGED_POOL_SPIN_US": spin_us} if spin_us else {})}


def launch_args(model: str, args: argparse.Namespace) -> list[str]:
    return ["--model-path", model, "--device", "cpu", "--attention-backend", "ragged",
            "--ragged-profile", args.profile, "--ragged-precision", args.precision,
            "--max-total-tokens", str(args.max_total_tokens),
            "--max-running-requests", str(max(*args.concurrency, args.long_concurrency)),
            "--page-size", "64", "--chunked-prefill-size", "2048"]


async def long_round(base_url: str, concurrency: int, prompt_tokens: int, max_tokens: int,
                     seed: int) -> dict[str, Any]:
    """`concurrency` fresh documents of about `prompt_tokens` tokens at once: median TPOT."""
    records = [RequestRecord(session=i, turn=0, task="document", start=0.0)
               for i in range(concurrency)]
    payloads = []
    for i in range(concurrency):
        payload = chat_payload([{"role": "user", "content": document(seed * 100 + i, prompt_tokens)
                                 + "\nSummarize the document."}], max_tokens)
        payload["min_tokens"] = max_tokens
        payloads.append(payload)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(stream_chat(http, base_url, p, r, t0)
                                      for p, r in zip(payloads, records, strict=True)))
    errors = [r.error for r in done if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {concurrency} requests failed: {errors[0]}")
    return {"tpot_s": statistics.median(r.tpot for r in done if r.tpot is not None),
            "prompt_tokens": statistics.median(r.prompt_tokens for r in done)}


async def contention_round(urls: list[str], concurrency: int, max_tokens: int,
                           seed: int) -> dict[str, Any]:
    """A short round sent to every server at the same moment: summed tokens / longest wall."""
    results = await asyncio.gather(*(one_round(url, concurrency, max_tokens, seed=seed + i)
                                     for i, url in enumerate(urls)))
    tokens = sum(r["tokens"] for r in results)
    return {"tok_s": tokens / max(r["seconds"] for r in results)}


def measure(servers: dict[str, list[str]], args: argparse.Namespace) -> dict[str, Any]:
    """Every kind of round, alternating over the spin counts; medians per count."""
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in servers}
    total = args.warmup + args.repeats
    for r in range(total):
        for spin, urls in cpu_sweep.round_order(servers.items(), r):  # who goes first swaps
            got: dict[str, float] = {}
            for c in args.concurrency:
                got[f"short_{c}_tok_s"] = asyncio.run(
                    one_round(urls[0], c, args.max_tokens, seed=100 * r + c))["tok_s"]
            if args.long_prompt:
                got["long_tpot_s"] = asyncio.run(long_round(
                    urls[0], args.long_concurrency, args.long_prompt, args.max_tokens,
                    seed=1000 + 10 * r))["tpot_s"]
            if args.contention:
                got["contention_tok_s"] = asyncio.run(contention_round(
                    urls, max(args.concurrency), args.max_tokens, seed=5000 + 100 * r))["tok_s"]
            if r >= args.warmup:
                for key, value in got.items():
                    samples[spin].setdefault(key, []).append(value)
        print(f"    round {r + 1}/{total} done", flush=True)
    return {spin: {key: statistics.median(values) for key, values in keys.items()}
            for spin, keys in samples.items()}


def markdown(report: dict[str, Any]) -> str:
    spins = list(report["spins"])
    first = report["spins"][spins[0]]
    lines = [f"Decode of `{report['served']}` on the CPU per GOMP_SPINCOUNT (0: sleep at once, "
             f"as OMP_WAIT_POLICY=PASSIVE), {report['max_tokens']}-token answers, medians of "
             f"{report['repeats']} alternating rounds; ratios against {spins[0]} (higher is "
             "faster).", "",
             "| round | " + " | ".join(f"spin {s}" for s in spins) + " | "
             + " | ".join(f"{s} / {spins[0]}" for s in spins[1:]) + " |",
             "|---|" + "---|" * (2 * len(spins) - 1)]
    rows = [(f"short, {c} requests (tok/s)", f"short_{c}_tok_s", False)
            for c in report["concurrency"]]
    if report["long_prompt"]:
        rows.append((f"{report['long_concurrency']} x {report['long_prompt']}-token documents "
                     "(TPOT ms)", "long_tpot_s", True))
    if report["contention"]:
        rows.append((f"two servers at once, {max(report['concurrency'])} requests each "
                     "(tok/s, summed)", "contention_tok_s", False))
    for label, key, is_time in rows:
        cells = [f"{report['spins'][s][key] * (1e3 if is_time else 1):.1f}" for s in spins]
        ratios = []
        for s in spins[1:]:
            x = report["spins"][s][key]
            ratios.append(f"x{(first[key] / x if is_time else x / first[key]):.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spins", nargs="+", type=spin_setting, default=["0", "3000"],
                   help="GOMP_SPINCOUNT values, the first the reference; SPIN:MACS also sets "
                        "RAGGED_DOT_SERIAL_MACS")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--long-prompt", type=int, default=1900,
                   help="tokens of each long round's documents (0: no long rounds)")
    p.add_argument("--long-concurrency", type=int, default=8)
    p.add_argument("--contention", action="store_true",
                   help="also two servers per spin count decoding at once")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--precision", default=DEFAULT_PRECISION)
    p.add_argument("--max-total-tokens", type=int, default=40000)
    p.add_argument("--out", type=Path, default=Path("results/omp-spin"))
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.repeats < 1 or args.max_tokens < 2 \
            or args.long_prompt < 0 or args.long_concurrency < 1:
        p.error("--concurrency, --long-concurrency and --repeats must be at least 1, "
                "--max-tokens at least 2, --long-prompt at least 0")
    if len(set(args.spins)) != len(args.spins):
        p.error(f"--spins repeats a value: {args.spins}")
    from bench.servers import start_all
    from sgl_ragged.models.smollm2 import ensure_smollm2

    server_args = launch_args(args.model or str(ensure_smollm2()), args)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "served": f"ragged {args.precision}:{args.profile}", "launch_args": server_args,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "concurrency": args.concurrency,
        "long_prompt": args.long_prompt, "long_concurrency": args.long_concurrency,
        "contention": args.contention, "spins": {}}
    per_spin = 2 if args.contention else 1
    with contextlib.ExitStack() as stack:
        urls = iter(start_all(stack, server_args, [
            (f"{setting_env(spin)} ({j + 1} of {per_spin})", setting_env(spin),
             args.out / f"server-spin{spin.replace(':', '-').replace('/', '-').replace('@', '-')}-{j}.log")
            for spin in args.spins for j in range(per_spin)]))
        servers = {spin: [next(urls) for _ in range(per_spin)] for spin in args.spins}
        print(f"measuring {args.warmup} + {args.repeats} rounds ...", flush=True)
        report["spins"] = measure(servers, args)
    cpu_sweep.write(args.out, "omp_spin", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
