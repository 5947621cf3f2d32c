"""What history holds (serving/history_holds.py) cost the scheduler, per iteration and arrival.

Holds run in the scheduler's loop: every `get_new_batch_prefill` sweeps the waiting queue (which
requests continue a held conversation, which conversations came back, who is starving) and
puts held turns first. This times that work on synthetic queues, without a server: W waiting
requests (a quarter of them next turns of held conversations, the rest new sessions), H held
conversations and F finished ones remembered, every prompt opening with the same system prompt
(as chat templates render them) and L tokens long.

- `iteration`: one sweep plus the queue's reordering, every waiting request already seen (what
  each scheduler step pays while the queue stands still);
- `arrival`: a sweep that sees `--arrivals` new requests, per new request (what judging them
  against the finished conversations costs).

With `--against REV` the same cases run on history_holds.py as of git revision REV too, side by
side in one process (the two take turns within every repeat), and the table gives both medians
and their ratio (this tree's over REV's).
Writes <out>/holds_overhead.json and holds_overhead.md.

    python -m bench.holds_overhead                          # this tree
    python -m bench.holds_overhead --against f6007ab        # and an older revision beside it
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from bench.cpu_sweep import round_order

REPO = Path(__file__).resolve().parents[1]
MODULE = "sgl_ragged/serving/history_holds.py"
SYSTEM = 256  # tokens every prompt opens with (a chat template's system prompt)
DEFAULT_CASES = ((16, 8, 16), (256, 32, 64), (1024, 64, 128), (2048, 128, 256))


def load(rev: str | None) -> ModuleType:
    """history_holds as in this tree, or as of git revision `rev` (its source, loaded apart)."""
    if rev is None:
        from sgl_ragged.serving import history_holds

        return history_holds
    source = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"history_holds_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"history_holds_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tree() -> SimpleNamespace:
    return SimpleNamespace(lock=lambda node: node, unlock=lambda lock: None)


def _conversation(rng: random.Random, length: int) -> list[int]:
    return [1] * SYSTEM + [rng.randrange(2, 50000) for _ in range(length - SYSTEM)]


def build(module: ModuleType, waiting: int, held: int, finished: int, length: int,
          page: int, seed: int) -> tuple[Any, list[Any], SimpleNamespace, random.Random]:
    """A HistoryHolds with `held` holds and `finished` conversations remembered (the held ones
    among them), and `waiting` requests: a quarter next turns of held conversations; its clock
    reads `clock.now`."""
    rng = random.Random(seed)
    clock = SimpleNamespace(now=1000.0)
    holds = module.HistoryHolds(_tree(), 60.0, page, clock=lambda: clock.now, min_outcomes=10**9)
    conversations = []
    for i in range(max(held, finished)):
        tokens = _conversation(rng, length)
        conversations.append(tokens)
        if i == held:  # the rest are remembered, not held: they finish while holds are not taken
            holds.min_outcomes = 0
            holds.outcomes.extend([False] * module.RETURN_WINDOW)
        holds.take(("node", i), tokens)
    queue = []
    for r in range(waiting):
        if r % 4 == 0 and held:
            prompt = conversations[rng.randrange(held)] + [rng.randrange(2, 50000) for _ in range(40)]
        else:
            prompt = _conversation(rng, length)
        queue.append(SimpleNamespace(rid=f"r{r}", origin_input_ids=prompt))
    return holds, queue, clock, rng


def time_case(modules: dict[str, ModuleType], waiting: int, held: int, finished: int,
              length: int, page: int, arrivals: int, repeats: int,
              seed: int) -> dict[str, dict[str, float]]:
    """Median seconds of one steady iteration and of one arrival, per module. The modules take
    turns within every repeat, in alternating order, so that the machine's drift during a case
    (these shared machines drift by some percent within minutes) falls on them alike."""
    states = {name: build(module, waiting, held, finished, length, page, seed)
              for name, module in modules.items()}
    steady: dict[str, list[float]] = {name: [] for name in modules}
    per_arrival: dict[str, list[float]] = {name: [] for name in modules}
    for holds, queue, _, _ in states.values():
        holds.sweep(queue)  # every request seen once
    for k in range(repeats):
        for name in round_order(modules, k):
            holds, queue, clock, _ = states[name]
            clock.now += 0.001
            t = time.perf_counter()
            holds.sweep(queue)
            holds.held_turns_first(queue)
            steady[name].append(time.perf_counter() - t)
    for k in range(repeats):
        for name in round_order(modules, k):
            holds, queue, clock, rng = states[name]
            new = [SimpleNamespace(rid=f"a{k}-{i}", origin_input_ids=_conversation(rng, length))
                   for i in range(arrivals)]
            clock.now += 0.001
            t = time.perf_counter()
            holds.sweep(queue + new)
            per_arrival[name].append((time.perf_counter() - t) / arrivals)
    return {name: {"iteration_s": statistics.median(steady[name]),
                   "arrival_s": statistics.median(per_arrival[name])} for name in modules}


def _parse_case(text: str) -> tuple[int, int, int]:
    try:
        w, h, f = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case expects W,H,F (waiting, held, finished), "
                                         f"e.g. 1024,64,512; got {text!r}") from None
    if min(w, h, f) < 0 or f < h:
        raise argparse.ArgumentTypeError(f"--case {text}: counts must be >= 0 and F (finished, "
                                         "the held ones among them) at least H")
    return w, h, f


def markdown(result: dict[str, Any]) -> str:
    against = result["against"]
    head = "| waiting | held | finished | iteration (ms) | per arrival (us) |"
    rule = "|---|---|---|---|---|"
    if against:
        head = (f"| waiting | held | finished | iteration (ms), this tree | {against} | ratio "
                f"| per arrival (us), this tree | {against} | ratio |")
        rule = "|---|---|---|---|---|---|---|---|---|"
    lines = [head, rule]
    for row in result["rows"]:
        now = row["this"]
        cells = [str(row["waiting"]), str(row["held"]), str(row["finished"])]
        for key, scale, fmt in (("iteration_s", 1e3, ".3f"), ("arrival_s", 1e6, ".1f")):
            cells.append(f"{now[key] * scale:{fmt}}")
            if against:
                old = row["against"][key]
                cells += [f"{old * scale:{fmt}}", f"x{now[key] / old:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", type=_parse_case, action="append",
                        help="W,H,F: waiting requests, held and finished conversations "
                             f"(repeatable; default {' '.join(','.join(map(str, c)) for c in DEFAULT_CASES)})")
    parser.add_argument("--length", type=int, default=2048, help="tokens a prompt (default 2048)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--arrivals", type=int, default=16, help="new requests a timed sweep sees")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--against", metavar="REV", help="also time history_holds.py of this "
                                                          "git revision, side by side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/holds_overhead"))
    args = parser.parse_args(argv)
    if args.length <= SYSTEM + 2 * args.page_size:
        parser.error(f"--length must exceed {SYSTEM + 2 * args.page_size} (the system prompt "
                     "and two pages)")
    modules = {"this": load(None)}
    if args.against:
        modules["against"] = load(args.against)
    cases = args.case or list(DEFAULT_CASES)
    rows = []
    for i, (w, h, f) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {w} waiting, {h} held, {f} finished ...", file=sys.stderr,
              flush=True)
        row = {"waiting": w, "held": h, "finished": f}
        row.update(time_case(modules, w, h, f, args.length, args.page_size, args.arrivals,
                             args.repeats, args.seed))
        rows.append(row)
    result = {"argv": sys.argv[1:] if argv is None else argv, "against": args.against,
              "length": args.length, "page_size": args.page_size, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "holds_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (args.out / "holds_overhead.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
