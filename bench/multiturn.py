"""Multi-turn serving benchmark: many concurrent shared-context sessions against SGLang's
OpenAI-compatible chat endpoint (streamed, for TTFT and TPOT).

    # a server somebody started (with --enable-metrics --enable-cache-report):
    python -m bench.multiturn --base-url http://127.0.0.1:30000 --out results/multiturn
    # or launch each server in turn at the same KV memory budget, same workload and seed:
    python -m bench.multiturn --launch baseline --launch ragged:uniform:0.3 \
        --kv-budget-tokens 16384 --sessions 32 --turns 3 --context-tokens 3000 \
        --concurrency 8 --out results/multiturn
    # N workers (each at that budget) behind SGLang's router, by routing policy:
    python -m bench.multiturn --launch router:2:cache_aware:ragged:uniform:0.3 \
        --launch router:2:round_robin:ragged:uniform:0.3 --kv-budget-tokens 8192 ...
    # a flag on and off (words after a target are its own launch_server arguments), all servers
    # up at once and measured in alternation, three rounds (medians in multiturn.md):
    python -m bench.multiturn --launch ragged:uniform:0.3 \
        --launch 'ragged:uniform:0.3 --ragged-hold-history 2' --rounds 3 ...
    # on a GPU (stock `triton`, here also with fp8 KV entries; scripts/gpu_multiturn.sh):
    python -m bench.multiturn --device cuda --model M --launch baseline \
        --launch baseline@fp8_e4m3 --launch ragged@int4:uniform:0.3 ...

Each of `--concurrency` users runs one session at a time, turn after turn (an answer becomes
history); `--request-rate R` (repeatable: a sweep) additionally releases requests at Poisson
times of rate R per second. The cache is flushed and one warm-up request sent before each run.
Writes multiturn.json (every request, the /metrics timeline, summaries, ratios against the
baseline), multiturn.md and PNG plots (bench/report.py); launched servers are written after each
one (a server that fails to start is reported, and the next one runs); `--start-together` starts
them all at once first and still measures one at a time. `--dry-run` prints what each launched
server would get (budget, arguments, environment) and starts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from bench import report
from bench.client import MetricsPoller, RequestRecord, chat_payload, stream_chat
from bench.servers import STOCK_BACKEND, Budget, Target, equal_budget, launch_args, launch_env
from bench.stats import summarize
from bench.tokens import make_counter
from bench.workloads import TASKS, Session, WorkloadConfig, build_sessions


@dataclass(frozen=True)
class LoadConfig:
    """How the sessions are offered to the server."""

    concurrency: int = 4  # users, each running one session at a time
    request_rate: float = math.inf  # requests/s released at Poisson times; inf: closed loop
    max_tokens: int = 32
    seed: int = 0
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError(f"--concurrency and --max-tokens must be >= 1, got "
                             f"{self.concurrency} and {self.max_tokens}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: no pacing), got {self.request_rate}")


class Arrivals:
    """Poisson release times (exponential gaps from a seeded rng); each request takes the next."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate, self.rng, self.next_at = rate, random.Random(f"arrivals:{seed}"), 0.0

    async def wait(self, t0: float) -> None:
        if math.isinf(self.rate):
            return
        self.next_at += self.rng.expovariate(self.rate)
        await asyncio.sleep(max(0.0, t0 + self.next_at - time.perf_counter()))


class Progress:
    """tqdm when installed, else a line every 10% on stderr."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, desc=desc, file=sys.stderr, mininterval=1.0)
        except ImportError:
            self.bar = None

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            print(f"{self.desc}: {self.done}/{self.total} requests", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _session(http: aiohttp.ClientSession, base_url: str, s: Session, load: LoadConfig,
                   arrivals: Arrivals, t0: float, progress: Progress) -> list[RequestRecord]:
    """One session's turns in order; each answer joins the history of the next turn."""
    answers: list[str] = []
    records = []
    for k, turn in enumerate(s.turns):
        await arrivals.wait(t0)
        rec = RequestRecord(s.id, k, s.task, time.perf_counter() - t0, expected=turn.answer)
        payload = chat_payload(s.messages(k, answers), load.max_tokens)
        records.append(await stream_chat(http, base_url, payload, rec, t0))
        answers.append(rec.text)
        progress.update()
    return records


async def run_load(base_url: str, sessions: list[Session], load: LoadConfig,
                   desc: str) -> tuple[list[RequestRecord], list[dict[str, float]]]:
    """Drive all sessions with `load.concurrency` users while polling /metrics."""
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    arrivals, progress = Arrivals(load.request_rate, load.seed), Progress(
        sum(len(s.turns) for s in sessions), desc)
    poller, stop = MetricsPoller(base_url), asyncio.Event()
    records: list[RequestRecord] = []

    async def user(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            records.extend(await _session(http, base_url, queue.get_nowait(), load, arrivals, t0,
                                          progress))

    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.perf_counter()
        polling = asyncio.create_task(poller.run(http, t0, stop))
        await asyncio.gather(*(user(http) for _ in range(load.concurrency)))
        stop.set()
        await polling
    progress.close()
    return sorted(records, key=lambda r: r.start), poller.samples


# ---- one run against one server ------------------------------------------------------------


def _http(base_url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def server_tokens(base_url: str) -> int | None:
    """The server's max_total_num_tokens (logical KV tokens), if it says."""
    for path in ("/server_info", "/get_server_info"):
        try:
            return int(_http(base_url, path)["max_total_num_tokens"])
        except (OSError, KeyError, TypeError, ValueError):
            continue
    return None


def prepare(base_url: str, flush: bool) -> None:
    """Flush the radix cache (so runs start alike), then one untimed warm-up request."""
    if flush:
        _http(base_url, "/flush_cache", {})
    _http(base_url, "/v1/chat/completions", {"model": "default", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "Say OK."}]})
    if flush:
        _http(base_url, "/flush_cache", {})


def run_one(base_url: str, label: str, sessions: list[Session], load: LoadConfig,
            flush: bool = True) -> dict[str, Any]:
    """One measured run: records, /metrics timeline and summary."""
    prepare(base_url, flush)
    rate = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"
    records, samples = asyncio.run(run_load(base_url, sessions, load, f"{label} rate={rate}"))
    summary = {**summarize(records, samples), "max_total_num_tokens": server_tokens(base_url)}
    return {"label": label, "concurrency": load.concurrency,
            "request_rate": None if math.isinf(load.request_rate) else load.request_rate,
            "summary": summary, "timeline": samples,
            "requests": [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot} for r in records]}


# ---- CLI -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_argument_group("servers (one of)")
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument("--launch", action="append", default=[],
                       metavar="baseline[@<kv dtype>]|ragged[@<precision>]:<profile>|"
                               "router:<N>:<policy>:<target>",
                       help="launch this server (repeatable); they run one after the other. "
                            "baseline@fp8_e4m3: stock with --kv-cache-dtype fp8_e4m3 (twice the "
                            "tokens in the same bytes). router:<N>:<policy>:<target>: N such "
                            "workers, each at the common budget, behind sglang_router (policy "
                            "cache_aware, round_robin, ...)")
    where.add_argument("--label", default="server", help="name of the --base-url run")
    where.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    where.add_argument("--kv-budget-tokens", type=int, default=16384,
                       help="common KV budget: the bytes of this many uncompressed tokens")
    where.add_argument("--max-running-requests", type=int, default=16)
    where.add_argument("--chunked-prefill-size", type=int, default=512)
    where.add_argument("--device", default="cpu", choices=tuple(STOCK_BACKEND),
                       help="of launched servers; cuda: the lent GPU machine's environment and "
                            "arguments (bench.servers.GPU_ENV, GPU_ARGS), stock on triton")
    where.add_argument("--start-together", action="store_true",
                       help="start every --launch server at once, then measure them one after "
                            "the other as usual (each alone; the others idle, each stopped after "
                            "its runs): one start's time instead of one per server, where the "
                            "machine holds them all (a lent GPU). A server that fails to start "
                            "beside the others is started again alone after them")
    where.add_argument("--rounds", type=int, default=1,
                       help="measure every launched server this many times, all of them up at "
                            "once, alternating their order round by round (an A/B on a machine "
                            "that drifts: multiturn.md adds the medians over the rounds)")
    where.add_argument("--dry-run", action="store_true",
                       help="print each --launch target's budget, arguments and environment "
                            "(and write plan.json); start nothing")
    where.add_argument("--server-arg", action="append", default=[],
                       help="extra launch_server argument for every launched server (repeatable; "
                            "use --server-arg=--flag)")
    work = p.add_argument_group("workload")
    work.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    work.add_argument("--sessions", type=int, default=16)
    work.add_argument("--turns", type=int, default=3)
    work.add_argument("--context-tokens", type=int, default=2000)
    work.add_argument("--sessions-per-context", type=int, default=1,
                      help="sessions of a task sharing one context (cross-session prefix hits)")
    work.add_argument("--tokenizer", help="'approx', 'server' or a checkpoint path "
                                          "(default: the model's, else the server's /tokenize)")
    work.add_argument("--seed", type=int, default=0)
    run = p.add_argument_group("load")
    run.add_argument("--concurrency", type=int, default=4)
    run.add_argument("--request-rate", type=float, action="append",
                     help="Poisson requests/s (repeatable: a sweep); default: no pacing")
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--no-flush", action="store_true", help="do not flush the cache between runs")
    p.add_argument("--out", type=Path, default=Path("results/multiturn"))
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if bool(args.base_url) == bool(args.launch):
        p.error("give either --base-url or at least one --launch")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.rounds > 1 and not args.launch:
        p.error("--rounds measures launched servers in alternation; give --launch targets "
                "(against --base-url, run the command again)")
    if args.dry_run and not args.launch:
        p.error("--dry-run shows what --launch would start; give at least one --launch")
    return args


def _window_pages(extra: list[str]) -> int:
    """--ragged-window-pages among the extra server args (it sizes the staging pool); the last
    one, as launch_server reads them."""
    pages = 1
    for i, arg in enumerate(extra):
        if arg == "--ragged-window-pages" or arg.startswith("--ragged-window-pages="):
            pages = int(arg.split("=", 1)[1] if "=" in arg else extra[i + 1])
    return pages


class Launch(NamedTuple):
    """One --launch target as it will be started."""

    target: Target
    budget: Budget
    server_args: list[str]  # launch_server arguments (launch_args)


class Launched(NamedTuple):
    """What the launched servers gave: their runs, and the targets that failed."""

    runs: list[dict[str, Any]]
    failed: list[dict[str, Any]]  # {"label", "launch_args", "error"}


def plan_launches(args: argparse.Namespace, model: str) -> list[Launch]:
    """Every --launch target with its budget and launch_server arguments."""
    launches = []
    for target in (Target.parse(spec) for spec in args.launch):
        budget = equal_budget(target, model, args.kv_budget_tokens, args.max_running_requests,
                              _window_pages([*args.server_arg, *target.extra]))
        server_args = launch_args(target, model, budget.kv_tokens,
                                  max_running=args.max_running_requests,
                                  chunk=args.chunked_prefill_size, device=args.device,
                                  extra=args.server_arg)
        launches.append(Launch(target, budget, server_args))
    return launches


def dry_run(args: argparse.Namespace, model: str, sessions: list[Session]) -> dict[str, Any]:
    """What --launch would start, and how large the concurrent histories are; nothing started."""
    contexts = sorted((s.context_tokens for s in sessions), reverse=True)
    targets = [{"label": launch.target.label, "budget": launch.budget._asdict(),
                "launch_args": launch.server_args} for launch in plan_launches(args, model)]
    return {"model": model, "device": args.device, "env": launch_env(args.device),
            # the contexts of the `concurrency` largest sessions: a lower bound of the live
            # histories' tokens (questions, answers and the chat template come on top)
            "concurrent_context_tokens": sum(contexts[:args.concurrency]), "targets": targets}


def run_launched(args: argparse.Namespace, model: str, sessions: list[Session],
                 loads: list[LoadConfig], save: Callable[[Launched], None]) -> Launched:
    """Each --launch target in turn at the common budget, every rate on each; `save` after each
    target. A target whose server fails (to start, or while it serves) is recorded and skipped.
    With --start-together every server starts at once first (`_start_together`); those that
    came up are measured in launch order, then the others, each started alone. --rounds above 1
    goes to `_run_rounds`."""
    from sgl_ragged.testing.server import ServerError

    launches, env = plan_launches(args, model), launch_env(args.device)
    logs = [args.out / "logs" / f"{_file_name(t.label)}.log" for t, _, _ in launches]
    if args.rounds > 1:
        return _run_rounds(args, launches, env, logs, sessions, loads, save)
    started: dict[int, tuple[Any, Any]] = {}
    if args.start_together and len(launches) > 1:
        started = _start_together(launches, env, logs)
    order = sorted(range(len(launches)), key=lambda i: i not in started)  # stable
    done = Launched([], [])
    try:
        for i in order:
            if i not in started:
                _announce(launches, i, "starting ...")
            try:
                with (_up(*started.pop(i)) if i in started
                      else _deployment(launches[i].target, launches[i].server_args, env,
                                       logs[i])) as server:
                    for load in loads:
                        done.runs.append(_measure(server, launches[i], sessions, load, args))
            except (ServerError, OSError) as exc:
                done.failed.append(_failure(launches[i], exc))
            save(done)
    finally:
        for deployment, _ in started.values():  # cut short: stop the ones not measured yet
            deployment.__exit__(None, None, None)
    return done


def _run_rounds(args: argparse.Namespace, launches: list[Launch], env: dict[str, str],
                logs: list[Path], sessions: list[Session], loads: list[LoadConfig],
                save: Callable[[Launched], None]) -> Launched:
    """--rounds N: every server up at once (`_start_together`; one that did not come up beside
    the others starts alone after them, and stays up too), then N rounds, each measuring every
    server in turn: in launch order in even rounds, reversed in odd ones (cpu_sweep.round_order),
    so the machine's drift over the rounds falls on every server alike and none always follows
    another. Runs carry their round; `save` after each round. A server that fails while it
    serves is recorded and left out of the later rounds."""
    from bench.cpu_sweep import round_order
    from sgl_ragged.testing.server import ServerError

    done = Launched([], [])
    with contextlib.ExitStack() as stack:
        started = _start_together(launches, env, logs)
        servers = {i: stack.enter_context(_up(*started[i])) for i in sorted(started)}
        for i in range(len(launches)):
            if i not in servers:
                _announce(launches, i, "starting alone ...")
                try:
                    servers[i] = stack.enter_context(_deployment(
                        launches[i].target, launches[i].server_args, env, logs[i]))
                except (ServerError, OSError) as exc:
                    done.failed.append(_failure(launches[i], exc))
        for round_ in range(args.rounds):
            for i in round_order(sorted(servers), round_):
                print(f"round {round_ + 1}/{args.rounds}: {launches[i].target.label}",
                      file=sys.stderr, flush=True)
                try:
                    for load in loads:
                        done.runs.append({**_measure(servers[i], launches[i], sessions, load,
                                                     args), "round": round_})
                except (ServerError, OSError) as exc:
                    done.failed.append(_failure(launches[i], exc))
                    del servers[i]
            save(done)
    return done


def _measure(server: Any, launch: Launch, sessions: list[Session], load: LoadConfig,
             args: argparse.Namespace) -> dict[str, Any]:
    """One run against a launched server, with what it was launched with."""
    run = run_one(server.base_url, launch.target.label, sessions, load, not args.no_flush)
    return {**run, "budget": launch.budget._asdict(), "launch_args": launch.server_args,
            "workers": launch.target.workers, "router_policy": launch.target.policy}


def _failure(launch: Launch, exc: BaseException) -> dict[str, Any]:
    """A launched target that failed (printed now, written in multiturn.json)."""
    label = launch.target.label
    print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[-1500:]}", file=sys.stderr, flush=True)
    return {"label": label, "launch_args": launch.server_args,
            "error": f"{type(exc).__name__}: {str(exc)[-4000:]}"}


def _file_name(label: str) -> str:
    """A launch label as a file name: `ragged:uniform:0.3 --ragged-hold-history 2` ->
    `ragged_uniform_0.3_--ragged-hold-history_2`."""
    return re.sub(r"[^A-Za-z0-9.=@+-]+", "_", label).strip("_")


def _start_together(launches: list[Launch], env: dict[str, str],
                    logs: list[Path]) -> dict[int, tuple[Any, Any]]:
    """Every launch's deployment started at once, a thread each (a start is mostly waiting on
    the child's imports, weights and graph captures): {launch index: (deployment, what entering
    it gave)} of those that came up. One that failed beside the others is printed and left out
    (run_launched starts it alone later); if this is interrupted, everything started stops."""
    from sgl_ragged.testing.server import ServerError

    deployments = [_deployment(t, a, env, log) for (t, _, a), log in zip(launches, logs,
                                                                        strict=True)]
    for i in range(len(launches)):
        _announce(launches, i, "starting beside the others ...")

    def start(deployment: Any) -> Any:
        try:
            return deployment.__enter__()
        except (ServerError, OSError) as exc:
            return exc

    pool = ThreadPoolExecutor(len(deployments))
    try:
        entered = [f.result() for f in [pool.submit(start, d) for d in deployments]]
    except BaseException:
        for d in deployments:
            d.__exit__(None, None, None)
        raise
    finally:
        pool.shutdown(wait=False)
    up = {}
    for i, (deployment, got) in enumerate(zip(deployments, entered, strict=True)):
        if isinstance(got, BaseException):
            print(f"{launches[i].target.label}: did not start beside the others "
                  f"({type(got).__name__}: {str(got)[-300:]}); it starts alone after them",
                  file=sys.stderr, flush=True)
        else:
            up[i] = (deployment, got)
    return up


def _announce(launches: list[Launch], i: int, what: str) -> None:
    """Launch i's line on stderr: its place, label and budget, then `what` is happening."""
    target, budget, _ = launches[i]
    print(f"[{i + 1}/{len(launches)}] {target.label}: --max-total-tokens {budget.kv_tokens} "
          f"(retention {budget.retention:.3f}), {what}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _up(deployment: Any, server: Any) -> Iterator[Any]:
    """A deployment `_start_together` started, as `with` gives it (server), stopped after."""
    try:
        yield server
    finally:
        deployment.__exit__(None, None, None)


def _deployment(target: Target, server_args: list[str], env: dict[str, str], log: Path) -> Any:
    """One server, or target.workers of them behind SGLang's router (logs under log's stem)."""
    from sgl_ragged.testing.router import RouterDeployment
    from sgl_ragged.testing.server import ServerProcess

    if target.policy is None:
        return ServerProcess(server_args, env=env, log_path=log, startup_timeout=900)
    return RouterDeployment(server_args, num_workers=target.workers, policy=target.policy,
                            log_dir=log.with_suffix(""), env=env, startup_timeout=900)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = args.model
    if args.launch and model is None:
        from sgl_ragged.models.smollm2 import ensure_smollm2

        model = str(ensure_smollm2())
    cfg = WorkloadConfig(sessions=args.sessions, turns=args.turns,
                         context_tokens=args.context_tokens, tasks=tuple(args.tasks.split(",")),
                         sessions_per_context=args.sessions_per_context, seed=args.seed)
    counter = make_counter(args.tokenizer, model=model, base_url=args.base_url)
    sessions = build_sessions(cfg, counter)
    loads = [LoadConfig(args.concurrency, rate, args.max_tokens, args.seed)
             for rate in (args.request_rate or [math.inf])]
    args.out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    if args.dry_run and args.launch:
        plan = dry_run(args, model, sessions)
        (args.out / "plan.json").write_text(json.dumps(plan, indent=1))
        print(json.dumps(plan, indent=1))
        return plan

    def save(so_far: Launched) -> None:  # after each launched server: a timeout keeps those
        report.write(report.build(so_far.runs, so_far.failed, workload=asdict(cfg), argv=argv),
                     args.out, plots=False)

    if args.base_url:
        done = Launched([run_one(args.base_url, args.label, sessions, load, not args.no_flush)
                         for load in loads], [])
    else:
        done = run_launched(args, model, sessions, loads, save)
    result = report.build(done.runs, done.failed, workload=asdict(cfg), argv=argv)
    table = report.write(result, args.out, plots=not args.no_plots and bool(done.runs))
    print(table)
    return result


if __name__ == "__main__":
    sys.exit(1 if main().get("failed") else 0)
