"""SGLang's own serving benchmark, `python -m sglang.bench_serving`, against servers launched at
equal KV bytes, measured in alternating rounds.

bench.multiturn drives its own client. This runs the tool SGLang users already measure servers
with, unchanged, as a subprocess: by default (DEFAULT_WORKLOAD) its multi-turn chat workload,
the generated-shared-prefix dataset with `--gsp-num-turns` (one conversation per group, a
random-token context then a question a turn, each answer joining the history of the next turn,
streamed through the OpenAI chat endpoint: `--backend sglang-oai-chat`), every server on the
same seed. Arguments after `--` go to sglang.bench_serving in place of DEFAULT_WORKLOAD.

    python -m bench.sglang_serving --launch baseline \\
        --launch ragged@mixed:calib_profiles/smollm2-135m-instruct/mixed-uniform-rho0.3.json \\
        --kv-budget-tokens 8192 --max-running-requests 16 --rounds 2 --out results/sglang-serving
    python -m bench.sglang_serving --base-url http://127.0.0.1:30000 -- --dataset-name random-ids \\
        --random-input-len 512 --random-output-len 32 --num-prompts 32 --max-concurrency 8

Launched servers (bench/servers.py: `baseline`, `baseline@<kv dtype>`, `ragged[@<precision>]:
<profile>`, each with its own launch_server arguments after it) start one after the other and
stay up; each round then measures every server in turn, in launch order in even rounds and
reversed in odd ones (cpu_sweep.round_order). Before each run bench_serving flushes the
server's cache (`--flush-cache`). Per run: bench_serving's own result line (its
`--output-file`), its output (logs/), and the server's counters over the run from /metrics
(prompt and cached tokens, retractions, evicted tokens; launched servers have
`--enable-metrics`). Writes sglang_serving.json and sglang_serving.md (medians over the rounds,
ratios against the first server) after every round. `--dry-run` prints each server's budget and
arguments and the bench_serving command, and starts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from bench.counters import COUNTERS, parse_counters
from bench.cpu_sweep import round_order
from bench.multiturn import Launch, _deployment, _failure, _file_name, plan_launches
from bench.servers import STOCK_BACKEND, launch_env

# sglang.bench_serving's workload unless arguments follow `--`: 16 conversations of 3 turns, each
# opening with its own ~1500-token context (16 groups of one prompt), 64-token questions and
# 32-token answers, 16 at once (what bench.multiturn's figures in docs/results.md run).
DEFAULT_WORKLOAD = ("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "16",
                    "--gsp-prompts-per-group", "1", "--gsp-system-prompt-len", "1500",
                    "--gsp-question-len", "64", "--gsp-output-len", "32", "--gsp-num-turns", "3",
                    "--max-concurrency", "16")
# What every run passes: the chat endpoint (multi-turn needs it), a flush before the run.
FIXED = ("--backend", "sglang-oai-chat", "--flush-cache")
# The server's counters read around each run, beyond bench.counters.COUNTERS.
TOKEN_COUNTERS = {"prompt_tokens": "sglang:prompt_tokens_total",
                  "cached_tokens": "sglang:cached_tokens_total"}
# Result fields of sglang.bench_serving kept per run (its --output-file line has them all).
FIELDS = ("completed", "duration", "request_throughput", "output_throughput",
          "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms",
          "median_e2e_latency_ms", "p99_e2e_latency_ms")


def bench_command(base_url: str, model: str, workload: list[str], output_file: Path,
                  seed: int) -> list[str]:
    """The sglang.bench_serving command line of one run."""
    return [sys.executable, "-m", "sglang.bench_serving", *FIXED, "--base-url", base_url,
            "--model", model, "--seed", str(seed), "--output-file", str(output_file), *workload]


def server_counters(base_url: str) -> dict[str, float] | None:
    """The server's counters now (parse_server_counters); None where /metrics does not answer."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=60) as resp:
            return parse_server_counters(resp.read().decode())
    except OSError:
        return None


def parse_server_counters(text: str) -> dict[str, float] | None:
    """COUNTERS and TOKEN_COUNTERS of a /metrics page (each summed over its label sets); None
    where it has no SGLang metrics (a server without --enable-metrics)."""
    if "sglang:" not in text:
        return None
    return parse_counters(text, {**COUNTERS, **TOKEN_COUNTERS})


def run_one(base_url: str, label: str, model: str, workload: list[str], seed: int,
            log: Path) -> dict[str, Any]:
    """sglang.bench_serving once against `base_url` (its output on stderr and in `log`): its
    FIELDS, and the server's counters over the run."""
    before = server_counters(base_url)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.jsonl"
        command = bench_command(base_url, model, workload, result_file, seed)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            out.write(" ".join(command) + "\n")
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            for line in proc.stdout:
                sys.stderr.write(line)
                out.write(line)
            code = proc.wait()
        if code != 0 or not result_file.exists():
            raise RuntimeError(f"{label}: sglang.bench_serving exited with {code}; its output "
                               f"is in {log}")
        result = json.loads(result_file.read_text().splitlines()[-1])
    after = server_counters(base_url)
    counters = None
    if before is not None and after is not None:
        counters = {name: round(after[name] - before[name]) for name in before}
    return {"label": label, **{f: result.get(f) for f in FIELDS}, "counters": counters}


def cached_share(run: dict[str, Any]) -> float | None:
    """Prompt tokens the server found cached, over all prompt tokens of the run."""
    c = run.get("counters")
    if not c or not c.get("prompt_tokens"):
        return None
    return c["cached_tokens"] / c["prompt_tokens"]


def summarize(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Per label (in launch order): medians over its rounds, and its req/s over the first
    label's median."""
    rows = []
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        if not mine:
            continue
        row = {"label": label, "rounds": len(mine),
               "request_throughput_each": [r["request_throughput"] for r in mine]}
        for f in FIELDS[1:]:
            values = [r[f] for r in mine if r.get(f) is not None]
            row[f] = statistics.median(values) if values else None
        shares = [s for s in map(cached_share, mine) if s is not None]
        row["cached_share"] = statistics.median(shares) if shares else None
        row["retracted"] = sum((r["counters"] or {}).get("retracted", 0) for r in mine)
        rows.append(row)
    if rows and rows[0]["request_throughput"]:
        for row in rows:
            row["ratio"] = row["request_throughput"] / rows[0]["request_throughput"]
    return rows


def markdown(result: dict[str, Any]) -> str:
    """The summary table (medians over the rounds)."""
    tokens = {t["label"]: t["budget"]["kv_tokens"] for t in result.get("targets", [])}
    lines = ["| server | KV tokens (logical) | req/s, each round | req/s (median) | ratio | "
             "output tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 (ms) | prompt cached | "
             "retracted |", "|---|---|---|---|---|---|---|---|---|---|"]

    def num(x: Any, scale: float = 1.0, fmt: str = ".3f") -> str:
        return "-" if x is None else f"{x * scale:{fmt}}"

    for row in result["summary"]:
        each = ", ".join(num(x) for x in row["request_throughput_each"])
        ttft = " / ".join(num(row[f], 1e-3, ".1f") for f in ("median_ttft_ms", "p90_ttft_ms",
                                                               "p99_ttft_ms"))
        share = "-" if row["cached_share"] is None else f"{row['cached_share']:.0%}"
        lines.append(f"| {row['label']} | {tokens.get(row['label'], '-')} | {each} | "
                     f"{num(row['request_throughput'])} | x{num(row.get('ratio'), fmt='.2f')} | "
                     f"{num(row['output_throughput'], fmt='.1f')} | {ttft} | "
                     f"{num(row['median_tpot_ms'], fmt='.0f')} | {share} | {row['retracted']} |")
    for failed in result.get("failed", []):
        lines.append(f"| {failed['label']} | FAILED: {failed['error'][:200]} |")
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang_serving.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out / "sglang_serving.md").write_text(table)
    return table


def run_rounds(args: argparse.Namespace, launches: list[Launch], model: str,
               workload: list[str], save: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every launched server up (one after the other), then --rounds rounds over them; a server
    that fails to start or while it serves is recorded and left out."""
    from sgl_ragged.testing.server import ServerError

    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    env = launch_env(args.device)
    with contextlib.ExitStack() as stack:
        urls = {}
        for i, launch in enumerate(launches):
            log = args.out / "logs" / f"{_file_name(launch.target.label)}.log"
            print(f"[{i + 1}/{len(launches)}] {launch.target.label}: --max-total-tokens "
                  f"{launch.budget.kv_tokens}, starting ...", file=sys.stderr, flush=True)
            try:
                urls[i] = stack.enter_context(_deployment(launch.target, launch.server_args, env,
                                                          log)).base_url
            except (ServerError, OSError) as exc:
                failed.append(_failure(launch, exc))
        for round_ in range(args.rounds):
            for i in round_order(sorted(urls), round_):
                label = launches[i].target.label
                print(f"round {round_ + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
                log = args.out / "logs" / f"{_file_name(label)}.round{round_ + 1}.bench.txt"
                try:
                    runs.append({**run_one(urls[i], label, model, workload, args.seed, log),
                                 "round": round_})
                except (ServerError, OSError, RuntimeError) as exc:
                    failed.append(_failure(launches[i], exc))
                    del urls[i]
            save(runs, failed)
    return runs, failed


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, workload = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, list(DEFAULT_WORKLOAD))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="a running server instead of --launch")
    p.add_argument("--launch", action="append", default=[],
                   help="baseline[@<kv dtype>] or ragged[@<precision>]:<profile>, optionally "
                        "followed by its own launch_server arguments (repeatable)")
    p.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kv-budget-tokens", type=int, default=8192,
                   help="common KV budget: the bytes of this many uncompressed tokens")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--device", default="cpu", choices=tuple(STOCK_BACKEND))
    p.add_argument("--server-arg", action="append", default=[],
                   help="launch_server argument for every launched server (--server-arg=--flag)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=1, help="sglang.bench_serving's --seed")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", type=Path, default=Path("results/sglang_serving"))
    args = p.parse_args(own)
    if bool(args.base_url) == bool(args.launch):
        p.error("give either --base-url or at least one --launch")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if any(t.startswith("router:") for t in args.launch):
        p.error("--launch router:... is bench.multiturn's; here each target is one server")
    for word in ("--base-url", "--host", "--port", "--output-file", "--model", "--backend",
                 "--seed"):
        if word in workload:
            p.error(f"{word} after -- is set by this benchmark; pass the workload's own "
                    "arguments there (--dataset-name, --num-prompts, ...)")
    return args, workload


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv_used = sys.argv[1:] if argv is None else argv
    args, workload = parse_args(argv_used)
    model = args.model
    if model is None:
        from sgl_ragged.models.smollm2 import ensure_smollm2

        model = str(ensure_smollm2())
    launches = plan_launches(args, model) if args.launch else []
    targets = [{"label": x.target.label, "budget": x.budget._asdict(), "launch_args": x.server_args}
               for x in launches]
    base = {"argv": argv_used, "model": model, "workload": workload, "targets": targets}
    if args.dry_run:
        plan = {**base, "bench_serving": bench_command("<base url>", model, workload,
                                                       Path("<output file>"), args.seed)}
        print(json.dumps(plan, indent=1))
        return plan
    labels = [x.target.label for x in launches] or ["server"]

    def save(runs: list[dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
        result = {**base, "runs": runs, "failed": failed, "summary": summarize(runs, labels)}
        print(write(result, args.out), flush=True)
        return result

    if args.base_url:
        run = run_one(args.base_url, "server", model, workload, args.seed,
                      args.out / "logs" / "server.bench.txt")
        return save([{**run, "round": 0}], [])
    runs, failed = run_rounds(args, launches, model, workload, save)
    return save(runs, failed)


if __name__ == "__main__":
    sys.exit(1 if main().get("failed") else 0)
