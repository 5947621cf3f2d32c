"""Server starts on the CPU: children forked (compat/cpu_start.py) against spawned, side by side.

Each round starts the same server once per start method (RAGGED_CPU_START_METHOD=auto, which
forks a CPU server's children, and =spawn, SGLang's own way), the order alternating from round
to round, and stops it before the next. For each start it records the seconds until
/health_generate answers, the CPU-seconds the launcher and its children used until then, and the
memory the tree holds (the sum of each process's proportional set size, shared pages split
between the processes that map them). Prints and writes medians and the fork/spawn ratios:
<out>/server_start.json and server_start.md.

    python -m bench.server_start --rounds 3                    # the README's ragged server
    python -m bench.server_start --rounds 3 --backend torch_native   # stock SGLang
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

from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE
from sgl_ragged.testing.server import ServerProcess

METHODS = {"fork": "auto", "spawn": "spawn"}  # label -> RAGGED_CPU_START_METHOD
METRICS = ("ready_s", "cpu_s", "pss_gb")


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


def start_once(args: list[str], method: str, log_dir: Path) -> dict[str, float]:
    """One server start under `method`: its ready time, CPU-seconds and memory, then stop it."""
    log = log_dir / f"{method}-{time.monotonic_ns()}.log"
    server = ServerProcess(args, env={"RAGGED_CPU_START_METHOD": METHODS[method]},
                           log_path=log, startup_timeout=900)
    server.start()
    try:
        assert server.proc is not None
        if f"start by {method}" not in server.log_text():
            raise RuntimeError(f"the server did not start its children by {method}: see {log}")
        cpu, pss = _tree_usage(psutil.Process(server.proc.pid))
        return {"ready_s": float(server.startup_seconds or 0.0), "cpu_s": cpu, "pss_gb": pss}
    finally:
        server.stop()


def measure(args: list[str], rounds: int, log_dir: Path) -> dict[str, list[dict[str, float]]]:
    """`rounds` starts per method, alternating which goes first."""
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = list(METHODS) if r % 2 == 0 else list(reversed(METHODS))
        for method in order:
            sample = start_once(args, method, log_dir)
            samples[method].append(sample)
            print(f"round {r + 1}/{rounds} {method}: ready {sample['ready_s']:.1f} s, "
                  f"{sample['cpu_s']:.1f} CPU-s, {sample['pss_gb']:.2f} GB", flush=True)
    return samples


def summarize(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Medians per method, and fork/spawn ratios."""
    medians = {m: {k: statistics.median(s[k] for s in samples[m]) for k in METRICS}
               for m in samples}
    medians["fork/spawn"] = {k: medians["fork"][k] / medians["spawn"][k] for k in METRICS}
    return medians


def markdown(summary: dict[str, dict[str, float]], rounds: int, backend: str) -> str:
    lines = [f"Server starts ({backend}, SmolLM2-135M-Instruct, --device cpu), medians of "
             f"{rounds} alternating rounds.", "",
             "| children | ready (s) | CPU-s until ready | memory (GB, PSS) |", "|---|---|---|---|"]
    for name, row in summary.items():
        fmt = "x{:.2f}" if "/" in name else "{:.1f}"
        mem = "x{:.2f}" if "/" in name else "{:.2f}"
        lines.append(f"| {name} | {fmt.format(row['ready_s'])} | {fmt.format(row['cpu_s'])} | "
                     f"{mem.format(row['pss_gb'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from sgl_ragged.models.smollm2 import ensure_smollm2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="ragged",
                        help="ragged (the README's server) or a stock --attention-backend")
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2, converted)")
    parser.add_argument("--out", type=Path, default=Path("results/server-start"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    model = args.model or str(ensure_smollm2())
    launch = server_args(model, args.backend)
    log_dir = Path(tempfile.mkdtemp(prefix="server-start-"))
    print(f"{args.rounds} rounds x {len(METHODS)} server starts; logs in {log_dir}", flush=True)
    samples = measure(launch, args.rounds, log_dir)
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
