"""Fault soak: multi-turn sessions whose clients abort at random points of the stream, against
a pool small enough that the radix cache evicts and decode retracts, with the pool's integrity
checked after every forward.

    python -m bench.soak --launch --out results/soak          # its own server (below)
    python -m bench.soak --base-url http://127.0.0.1:30000    # a server started with
        # --enable-metrics --ragged-check-integrity 1

Each of `--concurrency` users runs sessions of `--turns` streamed chat turns over a context of
`--context-tokens`; with probability `--abort-prob` a turn's client closes the connection after
a random number of chunks (0: right after the headers) and its partial answer becomes history.
What is reported comes from the server (bench/counters.py): requests finished and aborted,
retractions, evicted tokens, integrity checks and violations, and the pool's free tokens before
and after (they must match once the server is idle). Exit status 1 if any check fails.
Writes soak.json and soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import counters
from bench.corpus import sentence
from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE, README_QUESTION

PAGE = 64


@dataclass(frozen=True)
class SoakConfig:
    """The workload and the clients' behaviour."""

    sessions: int = 80
    turns: int = 3
    concurrency: int = 24
    context_tokens: int = 1000  # about 4 characters per token
    max_tokens: int = 64
    abort_prob: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.concurrency, self.max_tokens) < 1:
            raise ValueError("--sessions, --turns, --concurrency and --max-tokens must be >= 1")
        if not 0.0 <= self.abort_prob <= 1.0:
            raise ValueError(f"--abort-prob must be in [0, 1], got {self.abort_prob}")


@dataclass
class ClientTally:
    """What the clients did (for comparison with the server's counters)."""

    sent: int = 0
    completed: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)


def context(rng: random.Random, tokens: int) -> str:
    """Filler prose of about `tokens` tokens."""
    parts: list[str] = []
    while sum(map(len, parts)) < 4 * tokens:
        parts.append(sentence(rng))
    return " ".join(parts)


async def turn(http: aiohttp.ClientSession, base_url: str, messages: list[dict[str, str]],
               cfg: SoakConfig, abort_after: int | None, tally: ClientTally) -> str:
    """One streamed chat turn; the client hangs up after `abort_after` chunks unless None."""
    # min_tokens, not ignore_eos: SGLang's admission reserves the whole max_tokens of an
    # ignore_eos request, so decode could never outgrow the pool and retract.
    payload = {"model": "default", "messages": messages, "max_tokens": cfg.max_tokens,
               "min_tokens": cfg.max_tokens, "temperature": 0.7, "stream": True}
    pieces: list[str] = []
    tally.sent += 1
    try:
        async with http.post(base_url + "/v1/chat/completions", json=payload) as resp:
            if resp.status != 200:
                tally.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return ""
            async for raw in resp.content:
                if abort_after is not None and len(pieces) >= abort_after:
                    resp.close()  # hang up mid-stream: the server must abort the request
                    tally.aborted += 1
                    return "".join(pieces)
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        tally.errors.append(f"stream error: {chunk['error']}")
                        return "".join(pieces)
                    pieces += [(c.get("delta") or {}).get("content") or "" for c in chunk["choices"]]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        tally.errors.append(f"{type(exc).__name__}: {exc}")
        return ""
    tally.completed += 1
    return "".join(pieces)


async def session(http: aiohttp.ClientSession, base_url: str, index: int, cfg: SoakConfig,
                  tally: ClientTally) -> None:
    """One user's conversation; an aborted turn's partial answer stays in the history."""
    rng = random.Random(f"soak:{cfg.seed}:{index}")
    messages = [{"role": "user", "content": f"{context(rng, cfg.context_tokens)}\n"
                                            f"Retell the story above, part 1."}]
    for k in range(cfg.turns):
        abort_after = rng.randrange(cfg.max_tokens) if rng.random() < cfg.abort_prob else None
        answer = await turn(http, base_url, messages, cfg, abort_after, tally)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"Go on with part {k + 2}."}]


async def drive(base_url: str, cfg: SoakConfig) -> ClientTally:
    """All sessions, `cfg.concurrency` at a time."""
    tally, queue = ClientTally(), list(range(cfg.sessions))
    t0, done = time.perf_counter(), 0

    async def user(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while queue:
            await session(http, base_url, queue.pop(0), cfg, tally)
            done += 1
            print(f"[soak] {done}/{cfg.sessions} sessions, {tally.sent} requests "
                  f"({tally.aborted} hung up, {len(tally.errors)} errors), "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await asyncio.gather(*(user(http) for _ in range(cfg.concurrency)))
    return tally


def _chat(base_url: str, content: str) -> str:
    body = json.dumps({"model": "default", "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def run_soak(base_url: str, cfg: SoakConfig) -> dict[str, Any]:
    """The soak against a running server; the report of what the server counted."""
    idle = counters.wait_idle(base_url)
    before = counters.counters(base_url)
    t0 = time.perf_counter()
    tally = asyncio.run(drive(base_url, cfg))
    seconds = time.perf_counter() - t0
    after_state = counters.wait_idle(base_url, idle.used_tokens)
    server = counters.delta(before, counters.counters(base_url))
    report = {"config": asdict(cfg), "seconds": round(seconds, 1), "client": asdict(tally),
              "server": server, "evicted_pages": server["evicted_tokens"] // PAGE,
              "max_total_tokens": idle.max_total_tokens, "free_tokens_idle": idle.free_tokens,
              "free_tokens_after": after_state.free_tokens,
              "answer_after": _chat(base_url, README_QUESTION)}
    report["problems"] = problems(report)
    return report


def problems(report: dict[str, Any]) -> list[str]:
    """Every failed check of a soak report (empty: the server survived intact)."""
    server, out = report["server"], []
    if server["integrity_checks"] == 0:
        out.append("no integrity check ran: start the server with --ragged-check-integrity 1 "
                   "and --enable-metrics")
    if server["integrity_violations"]:
        out.append(f"{server['integrity_violations']} integrity violations")
    if report["free_tokens_after"] != report["free_tokens_idle"]:
        out.append(f"free tokens after the run {report['free_tokens_after']} != idle "
                   f"{report['free_tokens_idle']}: requests still hold pool tokens")
    if report["client"]["errors"]:
        out.append(f"{len(report['client']['errors'])} client errors, first: "
                   f"{report['client']['errors'][0]}")
    if not report["answer_after"]:
        out.append("no answer to a chat after the run")
    return out


def markdown(report: dict[str, Any]) -> str:
    """The soak's table."""
    c, s, cfg = report["client"], report["server"], report["config"]
    rows = [
        ("sessions x turns (concurrency)", f"{cfg['sessions']} x {cfg['turns']} ({cfg['concurrency']})"),
        ("requests sent / completed / hung up by the client", f"{c['sent']} / {c['completed']} / {c['aborted']}"),
        ("server: requests finished (`num_requests_total`)", s["requests"]),
        ("server: requests aborted (`num_aborted_requests_total`)", s["aborted"]),
        ("server: decode retractions (`num_retracted_requests_total`)", s["retracted"]),
        ("server: evicted tokens (pages) (`evicted_tokens_total`)", f"{s['evicted_tokens']} ({report['evicted_pages']})"),
        ("server: pages sealed", s["pages_sealed"]),
        ("server: integrity checks / violations", f"{s['integrity_checks']} / {s['integrity_violations']}"),
        ("pool: free tokens idle before / after (of max)",
         f"{report['free_tokens_idle']} / {report['free_tokens_after']} (of {report['max_total_tokens']})"),
        ("client errors", len(c["errors"])),
        ("wall time", f"{report['seconds']:.0f} s"),
        ("a chat afterwards", repr(report["answer_after"])),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    verdict = "all checks passed" if not report["problems"] else "; ".join(report["problems"])
    return "\n".join(lines) + f"\n\n{verdict}\n"


def launch_args(model: str, args: argparse.Namespace) -> list[str]:
    """A ragged server with a small pool, optimistic admission, metrics and the integrity check
    after every forward."""
    return ["--model-path", model, "--device", args.device, "--attention-backend", "ragged",
            "--ragged-profile", args.profile, "--ragged-precision", args.precision,
            "--ragged-check-integrity", "1",
            "--page-size", str(PAGE), "--chunked-prefill-size", "512",
            "--max-total-tokens", str(args.max_total_tokens),
            "--max-running-requests", str(args.max_running_requests),
            "--schedule-conservativeness", str(args.schedule_conservativeness), "--enable-metrics"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server (--enable-metrics, integrity checks on)")
    where.add_argument("--launch", action="store_true", help="start a ragged server for the soak")
    p.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="the served profile (default: serve.sh's, with --precision int4)")
    p.add_argument("--precision", default=DEFAULT_PRECISION, help="--ragged-precision")
    p.add_argument("--max-total-tokens", type=int, default=12288)
    p.add_argument("--max-running-requests", type=int, default=24)
    p.add_argument("--schedule-conservativeness", type=float, default=0.3,
                   help="SGLang's admission reserves 0.7 x this of each request's max_tokens; "
                        "below 1 decode outgrows the pool and retracts")
    p.add_argument("--device", default="cpu")
    for name, value in asdict(SoakConfig()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = SoakConfig(**{k: getattr(args, k) for k in asdict(SoakConfig())})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.base_url:
        report = run_soak(args.base_url, cfg)
    else:
        from sgl_ragged.models.smollm2 import ensure_smollm2
        from sgl_ragged.testing.server import ServerProcess

        server_args = launch_args(args.model or str(ensure_smollm2()), args)
        env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
        with ServerProcess(server_args, env=env, log_path=args.out / "server.log",
                           startup_timeout=900) as server:
            report = {**run_soak(server.base_url, cfg), "launch_args": server_args}
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "soak.md").write_text(table)
    print(table)
    if report["problems"]:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
