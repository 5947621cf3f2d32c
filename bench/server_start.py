"""Server starts on the CPU: children forked (compat/cpu_start.py) against spawned, side by side.

Each round starts the same server once per start method (RAGGED_CPU_START_METHOD=fork, which
forks a CPU server's children, the default, and =spawn, SGLang's own way), the order
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


def decode_seconds(base_url: str, tokens: int, repeats: int = 3) -> float:
    """Median seconds of one request decoding `tokens` greedy tokens, after a warm-up."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                "ignore_eos": True}}
    post(base_url, {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 8}})
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        post(base_url, body)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def start_once(args: list[str], method: str, log_dir: Path, decode_tokens: int = 0
               ) -> dict[str, float]:
    """One server start under `method`: its ready time, CPU-seconds and memory (and with
    `decode_tokens`, one request's decode seconds), then stop it."""
    log = log_dir / f"{method}-{time.monotonic_ns()}.log"
    server = ServerProcess(args, env={"RAGGED_CPU_START_METHOD": method},
                           log_path=log, startup_timeout=900)
    server.start()
    try:
        assert server.proc is not None
        if f"start by {method}" not in server.log_text():
            raise RuntimeError(f"the server did not start its children by {method}: see {log}")
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
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2, converted)")
    parser.add_argument("--out", type=Path, default=Path("results/server-start"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    model = args.model or str(ensure_smollm2())
    launch = server_args(model, args.backend)
    log_dir = Path(tempfile.mkdtemp(prefix="server-start-"))
    print(f"{args.rounds} rounds x {len(METHODS)} server starts; logs in {log_dir}", flush=True)
    samples = measure(launch, args.rounds, log_dir, args.decode_tokens)
    summary = summarize(samples)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_start.json").write_text(json.dumps(
        {"argv": sys.argv, "launch_args": launch, "samples": samples, "summary": summary},
        indent=2))
    table = markdown(summary, args.rounds, args.backend)
    (args.out / "server_start.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
