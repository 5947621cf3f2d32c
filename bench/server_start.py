"""Server starts on the CPU: children forked (compat/cpu_start.py) against spawned, side by side.

Each round starts the same server once per start method (RAGGED_CPU_START_METHOD=fork, which
forks a CPU server's children, and =spawn, the default and SGLang's own way), the order
alternating from round to round, and stops it before the next. For each start it records the seconds until
/health_generate answers, the CPU-seconds the launcher and its children used until then, and the
memory the tree holds (the sum of each process's proportional set size, shared pages split
between the processes that map them), and with --decode-tokens N the median seconds of one
request decoding N greedy tokens. Prints and writes medians and the fork/spawn ratios (for the
decode also the median of the rounds' own ratios: this machine's speed drifts between rounds
more than between two servers of one round): <out>/server_start.json and server_start.md.

    python -m bench.server_start --rounds 3                    # the README's ragged server
    python -m bench.server_start --rounds 3 --backend torch_native   # stock SGLang
    python -m bench.server_start --rounds 4 --decode-tokens 128      # and decode speed
    python -m bench.server_start --rounds 1 --decode-tokens 96 --paired-requests 24  # finer
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.accuracy_client import post
from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE
from sgl_ragged.testing.server import ServerProcess

METHODS = ("fork", "spawn")  # values of RAGGED_CPU_START_METHOD
METRICS = ("ready_s", "cpu_s", "pss_gb")
PROMPT = "Write a long story about a lighthouse keeper."


def server_args(model: str, backend: str) -> list[str]:
    """launch_server arguments: the README's ragged server, or stock with `backend`."""
    args = ["--model-path", model, "--device", "cpu", "--page-size", "64",
            "--max-total-tokens", "4096"]
    if backend == "ragged":
        return [*args, "--attention-backend", "ragged", "--ragged-profile",
                DEFAULT_PROFILE, "--ragged-precision", DEFAULT_PRECISION]
    return [*args, "--attention-backend", backend]


def _tree_usage(root: psutil.Process) -> tuple[float, float]:
    """(CPU-seconds, GB of proportional set size) of `root` and its live descendants."""
    cpu = pss = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            cpu += times.user + times.system
            pss += proc.memory_full_info().pss
        except psutil.NoSuchProcess:
            continue
    return cpu, pss / 2**30


def scheduler_seconds(root: psutil.Process) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting in the run queue) so far, summed over every thread of
    the scheduler processes under `root` (Linux's /proc/<pid>/task/<tid>/schedstat)."""
    on_cpu = queued = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            if "scheduler" not in proc.name():
                continue
            tasks = list(Path(f"/proc/{proc.pid}/task").iterdir())
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue
        for task in tasks:
            try:
                ran, waited, _ = (int(x) for x in (task / "schedstat").read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
            on_cpu, queued = on_cpu + ran, queued + waited
    return on_cpu / 1e9, queued / 1e9


def start_server(args: list[str], method: str, log: Path) -> ServerProcess:
    """The server started with RAGGED_CPU_START_METHOD=`method`, checked (its log) to have
    started its children so; stopped again if not."""
    server = ServerProcess(args, env={"RAGGED_CPU_START_METHOD": method}, log_path=log,
                           startup_timeout=900)
    server.start()
    if f"start by {method}" not in server.log_text():
        server.stop()
        raise RuntimeError(f"the server did not start its children by {method}: see {log}")
    return server


def request_seconds(base_url: str, tokens: int) -> float:
    """Seconds of one request decoding `tokens` greedy tokens."""
    t0 = time.monotonic()
    post(base_url, {"text": PROMPT, "sampling_params": {"max_new_tokens": tokens,
                                                        "temperature": 0, "ignore_eos": True}})
    return time.monotonic() - t0


def decode_seconds(base_url: str, tokens: int, repeats: int = 3) -> float:
    """Median seconds of one request decoding `tokens` greedy tokens, after a warm-up."""
    request_seconds(base_url, 8)
    return statistics.median(request_seconds(base_url, tokens) for _ in range(repeats))


def paired_decode(args: list[str], log_dir: Path, tokens: int, pairs: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Both servers up at once (the idle one sleeps: --sleep-on-idle) and `pairs` requests of
    `tokens` greedy tokens on each, alternating between them, the order swapped every pair. The
    machine's drift then moves both halves of a pair alike, where restarted servers' rounds are
    minutes apart (session 54: the rounds could not resolve a 3% difference, the pairs did).
    Returns each request's seconds per method, and its scheduler's CPU-seconds and run-queue
    seconds during it (`scheduler_seconds`: a slower request shows whether it computed longer
    or waited)."""
    servers: dict[str, ServerProcess] = {}
    try:
        for method in METHODS:
            servers[method] = start_server(args, method, log_dir / f"paired-{method}.log")
        roots = {m: psutil.Process(s.proc.pid) for m, s in servers.items()
                 if s.proc is not None}
        for server in servers.values():
            request_seconds(server.base_url, 8)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        counters: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for i in range(pairs):
            for method in METHODS if i % 2 == 0 else METHODS[::-1]:
                cpu0, wait0 = scheduler_seconds(roots[method])
                times[method].append(request_seconds(servers[method].base_url, tokens))
                cpu1, wait1 = scheduler_seconds(roots[method])
                counters[method].append({"cpu_s": cpu1 - cpu0, "wait_s": wait1 - wait0})
        return times, counters
    finally:
        for server in servers.values():
            server.stop()


def paired_summary(times: dict[str, list[float]],
                   counters: dict[str, list[dict[str, float]]] | None = None
                   ) -> dict[str, float]:
    """Medians per method and the pairs' fork/spawn ratios: median, mean, standard deviation
    and how many pairs were slower forked; with `counters`, the schedulers' median CPU-seconds
    and run-queue seconds a request and the mean of the pairs' CPU-seconds ratios."""
    ratios = [f / s for f, s in zip(times["fork"], times["spawn"], strict=True)]
    summary = {"pairs": len(ratios), "fork_s": statistics.median(times["fork"]),
               "spawn_s": statistics.median(times["spawn"]),
               "ratio_median": statistics.median(ratios), "ratio_mean": statistics.mean(ratios),
               "ratio_sd": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
               "slower_forked": sum(r > 1 for r in ratios)}
    if counters:
        for method in METHODS:
            for key in ("cpu_s", "wait_s"):
                summary[f"{method}_sched_{key}"] = statistics.median(
                    c[key] for c in counters[method])
        summary["sched_cpu_ratio_mean"] = statistics.mean(
            f["cpu_s"] / s["cpu_s"] for f, s in zip(counters["fork"], counters["spawn"],
                                                    strict=True))
    return summary


def paired_markdown(summary: dict[str, float], tokens: int) -> str:
    text = (f"Decode, both servers up, {summary['pairs']:.0f} alternating pairs of {tokens} "
            f"tokens: forked {summary['fork_s']:.2f} s, spawned {summary['spawn_s']:.2f} s "
            f"(medians); fork/spawn per pair median x{summary['ratio_median']:.3f}, mean "
            f"x{summary['ratio_mean']:.3f} (sd {summary['ratio_sd']:.3f}), "
            f"{summary['slower_forked']:.0f} pairs slower forked.\n")
    if "sched_cpu_ratio_mean" in summary:
        text += (f"Schedulers a request (medians): forked {summary['fork_sched_cpu_s']:.2f} "
                 f"CPU-s, {summary['fork_sched_wait_s']:.2f} s waiting for a CPU; spawned "
                 f"{summary['spawn_sched_cpu_s']:.2f} CPU-s, {summary['spawn_sched_wait_s']:.2f} "
                 f"s waiting; CPU-seconds fork/spawn per pair mean "
                 f"x{summary['sched_cpu_ratio_mean']:.3f}.\n")
    return text


def start_once(args: list[str], method: str, log_dir: Path, decode_tokens: int = 0
               ) -> dict[str, float]:
    """One server start under `method`: its ready time, CPU-seconds and memory (and with
    `decode_tokens`, one request's decode seconds), then stop it."""
    server = start_server(args, method, log_dir / f"{method}-{time.monotonic_ns()}.log")
    try:
        assert server.proc is not None
        cpu, pss = _tree_usage(psutil.Process(server.proc.pid))
        sample = {"ready_s": float(server.startup_seconds or 0.0), "cpu_s": cpu, "pss_gb": pss}
        if decode_tokens:
            sample["decode_s"] = decode_seconds(server.base_url, decode_tokens)
        return sample
    finally:
        server.stop()


def measure(args: list[str], rounds: int, log_dir: Path, decode_tokens: int = 0
            ) -> dict[str, list[dict[str, float]]]:
    """`rounds` starts per method, alternating which goes first."""
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = list(METHODS) if r % 2 == 0 else list(reversed(METHODS))
        for method in order:
            sample = start_once(args, method, log_dir, decode_tokens)
            samples[method].append(sample)
            print(f"round {r + 1}/{rounds} {method}: ready {sample['ready_s']:.1f} s, "
                  f"{sample['cpu_s']:.1f} CPU-s, {sample['pss_gb']:.2f} GB", flush=True)
    return samples


def summarize(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Medians per method, and fork/spawn ratios."""
    keys = [k for k in (*METRICS, "decode_s") if all(k in s for v in samples.values() for s in v)]
    medians = {m: {k: statistics.median(s[k] for s in samples[m]) for k in keys}
               for m in samples}
    medians["fork/spawn"] = {k: medians["fork"][k] / medians["spawn"][k] for k in keys}
    if "decode_s" in keys:
        rounds = zip(samples["fork"], samples["spawn"], strict=True)
        medians["fork/spawn"]["decode_paired"] = statistics.median(
            f["decode_s"] / s["decode_s"] for f, s in rounds)
    return medians


def markdown(summary: dict[str, dict[str, float]], rounds: int, backend: str) -> str:
    lines = [f"Server starts ({backend}, SmolLM2-135M-Instruct, --device cpu), medians of "
             f"{rounds} alternating rounds.", "",
             "| children | ready (s) | CPU-s until ready | memory (GB, PSS) | decode (s) |",
             "|---|---|---|---|---|"]
    for name, row in summary.items():
        fmt = "x{:.2f}" if "/" in name else "{:.1f}"
        mem = "x{:.2f}" if "/" in name else "{:.2f}"
        dec = ("x{:.3f}" if "/" in name else "{:.2f}").format(row["decode_s"]) \
            if "decode_s" in row else "-"
        lines.append(f"| {name} | {fmt.format(row['ready_s'])} | {fmt.format(row['cpu_s'])} | "
                     f"{mem.format(row['pss_gb'])} | {dec} |")
    paired = summary.get("fork/spawn", {}).get("decode_paired")
    if paired is not None:
        lines += ["", f"Decode, the median of each round's fork/spawn ratio: x{paired:.3f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from sgl_ragged.models.smollm2 import ensure_smollm2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="ragged",
                        help="ragged (the README's server) or a stock --attention-backend")
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="also time one request decoding this many tokens on each server")
    parser.add_argument("--paired-requests", type=int, default=0,
                        help="then both servers up at once, this many alternating pairs of "
                             "--decode-tokens requests (the finer decode comparison)")
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2, converted)")
    parser.add_argument("--out", type=Path, default=Path("results/server-start"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.paired_requests and not args.decode_tokens:
        parser.error("--paired-requests needs --decode-tokens")
    model = args.model or str(ensure_smollm2())
    launch = server_args(model, args.backend)
    log_dir = Path(tempfile.mkdtemp(prefix="server-start-"))
    print(f"{args.rounds} rounds x {len(METHODS)} server starts; logs in {log_dir}", flush=True)
    samples = measure(launch, args.rounds, log_dir, args.decode_tokens)
    summary = summarize(samples)
    table = markdown(summary, args.rounds, args.backend)
    result = {"argv": sys.argv, "launch_args": launch, "samples": samples, "summary": summary}
    if args.paired_requests:
        print(f"{args.paired_requests} alternating pairs on both servers", flush=True)
        times, counters = paired_decode(launch, log_dir, args.decode_tokens,
                                        args.paired_requests)
        result["paired"] = {"times": times, "scheduler": counters,
                            "summary": paired_summary(times, counters)}
        table += "\n" + paired_markdown(result["paired"]["summary"], args.decode_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_start.json").write_text(json.dumps(result, indent=2))
    (args.out / "server_start.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
