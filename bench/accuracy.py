"""Accuracy of compressed KV caches on the same held-out multi-turn sessions: full KV, uniform
budgets, static calibrated budgets (TANGRAM, "w/") and the dynamic reference ("w/o") per scorer.

    nice -n 5 python -m bench.accuracy --sessions 12 --out results/accuracy

Every configuration is a `--attention-backend ragged` server ("full" is `uniform:1.0`, which drops
nothing, so all configurations share one code path); servers run one after another. Per session,
turn 1's context is sent alone first so its pages are sealed (compressed) and cached; then each
question is sent teacher-forced with its reference history and reference answer, with logprobs
over the answer tokens and the closing <|im_end|>. Two metrics per question:

- exact match: the top-1 token equals the reference at every answer position (what greedy
  decoding would need to reproduce the answer token for token and stop);
- mean KL(full || config) of the next-token distributions over those positions, over the full
  run's top-K tokens plus one bucket for the rest of the mass (a lower bound of the true KL).

Writes raw/<config>.json (per question), accuracy.json, accuracy.md and kl_vs_rho.png. `--resume`
skips configurations whose raw file matches the workload; `--base-url` evaluates one running
server as `--config NAME` (the reference `full` first).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.accuracy_stats import binomial_se, kl_topk, mean_se, paired_diff
from bench.tokens import local_counter
from bench.workloads import Session, WorkloadConfig, build_sessions

SCORED_TASKS = ("kv", "needle", "code")
FULL = "full"


@dataclass(frozen=True)
class Config:
    """One server configuration: `kind` in full/uniform/static/static-mean/kvcompose/baklava/
    dynamic."""

    name: str
    kind: str
    rho: float
    scorer: str
    profile: str  # --ragged-profile
    precision: str = "bf16"  # --ragged-precision

    @property
    def is_dynamic(self) -> bool:
        """Whether this is the dynamic reference mode (--ragged-profile dynamic:<rho>)."""
        from sgl_ragged.profile import ModelFreeKind, model_free_kind

        return model_free_kind(self.profile) is ModelFreeKind.DYNAMIC

    def server_args(self) -> list[str]:
        return ["--attention-backend", "ragged", "--ragged-profile", self.profile,
                "--ragged-scorer", self.scorer, "--ragged-precision", self.precision]


def precision_configs(rhos: list[float], precisions: list[str], scorer: str) -> list[Config]:
    """Row tiers (DESIGN.md section 11) at uniform byte budgets: per low precision p, "p@rho"
    spends rho of the bytes by the default composition (tiers.compose: every token at p, the
    best upgraded, or the best at p and the rest dropped), and "p-all@r" keeps every token at p
    and nothing else (r: the budget that buys exactly that, in bf16 bytes). A pair "h+l" (e.g.
    int8+int4, `MIXED_SEP`) gives "h+l@rho": both tiers quantized (mixed.compose_mixed; offline
    only, bench.offline_loss)."""
    from sgl_ragged.precision import low_precision

    configs = []
    for p in precisions:
        if MIXED_SEP in p:
            mixed_formats(p)  # checks the pair
            configs += [Config(f"{p}@{rho}", "tiers-mixed", rho, scorer, f"uniform:{rho}", p)
                        for rho in sorted(rhos) if rho < 1.0]
            continue
        fmt = low_precision(p)
        whole = fmt.tier_bytes(64, 1, 64) / (2 * 64 * 64 * 2)  # a full page of p, bf16 SmolLM2
        r = round(-(-whole * 64 // 1) / 64, 6)  # whole slots of budget
        configs.append(Config(f"{p}-all@{r}", "tiers-all", r, scorer, f"uniform:{r}", p))
        configs += [Config(f"{p}@{rho}", "tiers", rho, scorer, f"uniform:{rho}", p)
                    for rho in sorted(rhos) if rho < 1.0]
    return configs


MIXED_SEP = "+"  # "int8+int4": the high tier's format + the low tier's


def mixed_formats(precision: str) -> tuple[Any, Any]:
    """The (hi, lo) LowPrecision formats of a pair "hi+lo" such as "int8+int4"."""
    from sgl_ragged.precision import LOW_PRECISIONS, low_precision

    parts = precision.split(MIXED_SEP)
    if len(parts) != 2 or not all(x in LOW_PRECISIONS for x in parts):
        raise ValueError(f"precision pair {precision!r}: expected <hi>{MIXED_SEP}<lo> with both in "
                         f"{list(LOW_PRECISIONS)}, e.g. int8{MIXED_SEP}int4")
    hi, lo = (low_precision(x) for x in parts)
    return hi, lo


def mixed_tiers(config: Config, shape: Any, page_size: int = 64) -> tuple[list[list[Any]], float]:
    """A "h+l@rho" configuration's row tiers [L][G] (mixed.compose_mixed per group of its
    profile) and its KV bytes per token as a fraction of a full bf16 cache."""
    from sgl_ragged.emulator.mixed import compose_mixed, mixed_tier_bytes
    from sgl_ragged.profile import resolve_profile
    from sgl_ragged.scoring import SINK_TOKENS

    hi_fmt, lo_fmt = mixed_formats(config.precision)
    profile = resolve_profile(config.profile, shape)
    budget_slots = profile.slots_per_group(page_size, min_slots=SINK_TOKENS)  # [L][G]
    tiers = [[compose_mixed(k, page_size, shape.head_dim, 2, hi_fmt, lo_fmt, SINK_TOKENS)
              for k in layer] for layer in budget_slots]
    kept = sum(mixed_tier_bytes(t, hi_fmt, lo_fmt, len(heads), shape.head_dim)
               for layer_groups, layer_tiers in zip(profile.groups, tiers, strict=True)
               for heads, t in zip(layer_groups, layer_tiers, strict=True))
    heads = sum(len(g) for g in profile.groups[0])
    full = 2 * len(profile.groups) * heads * page_size * shape.head_dim * 2
    return tiers, kept / full


def config_bytes(config: Config, shape: Any, page_size: int = 64) -> float:
    """KV bytes per logical token of a configuration, as a fraction of a full bf16 cache (the
    dynamic reference counts the entries it keeps, rho; its pages stay full-size)."""
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.profile import resolve_profile

    if config.is_dynamic:
        return config.rho
    if config.kind == "stock-fp8":
        return 0.5
    if MIXED_SEP in config.precision:
        return mixed_tiers(config, shape, page_size)[1]
    profile = resolve_profile(config.profile, shape)
    return RaggedLayout.from_profile(profile, page_size, shape.head_dim, 2, config.precision).retention


def other_sources() -> list[str]:
    """The budget sources besides TANGRAM's (whose profiles are the static configurations);
    a configuration of one has the source's name as its kind."""
    from sgl_ragged.sources import DEFAULT_SOURCE, SOURCES

    return [name for name in SOURCES if name != DEFAULT_SOURCE]


def equal_memory_file(source: str, scorer: str, rho: float) -> str:
    """The file name of a source's equal-memory profile: <prefix><scorer>-[mean-]rho<rho>.json,
    in budget mode mean (mean budget = rho) where the source has a margin
    (kvcompose-<s>-mean-rho<r>.json, baklava-<s>-rho<r>.json)."""
    from sgl_ragged.sources import make_source

    budget_source = make_source(source)
    mean = "mean-" if budget_source.margin else ""
    return f"{budget_source.output_prefix}{scorer}-{mean}rho{rho}.json"


def plan_configs(rhos: list[float], scorers: list[str], profile_dir: Path,
                 precisions: Sequence[str] = ()) -> tuple[list[Config], list[str]]:
    """full, then per rho (smallest first): uniform, and per scorer static (margin budgets),
    static-mean (mean budget = rho, where that profile exists), the other equal-memory budget
    sources where their profiles exist (kvcompose: kvcompose-<s>-mean-rho<r>.json, baklava:
    baklava-<s>-rho<r>.json) and dynamic. Returns the configurations and the margin profile
    files that do not exist (skipped)."""
    configs, missing = [Config(FULL, FULL, 1.0, scorers[0], "uniform:1.0")], []
    for rho in sorted(r for r in rhos if r < 1.0):
        configs.append(Config(f"uniform@{rho}", "uniform", rho, scorers[0], f"uniform:{rho}"))
        for s in scorers:
            path = profile_dir / f"{s}-rho{rho}.json"
            if path.is_file():
                configs.append(Config(f"static-{s}@{rho}", "static", rho, s, str(path)))
            else:
                missing.append(str(path))
            mean_path = profile_dir / f"{s}-mean-rho{rho}.json"
            if mean_path.is_file():
                configs.append(Config(f"static-mean-{s}@{rho}", "static-mean", rho, s, str(mean_path)))
            for source in other_sources():
                file = equal_memory_file(source, s, rho)
                if (profile_dir / file).is_file():
                    configs.append(Config(f"{source}-{s}@{rho}", source, rho, s, str(profile_dir / file)))
            configs.append(Config(f"dynamic-{s}@{rho}", "dynamic", rho, s, f"dynamic:{rho}"))
    return configs + precision_configs(rhos, list(precisions), scorers[0]), missing


# ---- token-level plan of the sessions -------------------------------------------------------


@dataclass(frozen=True)
class Question:
    session: int
    turn: int
    task: str
    input_ids: list[int]  # history + question + reference answer + <|im_end|>
    answer_start: int  # index of the first answer token in input_ids
    targets: list[int]  # reference answer tokens and <|im_end|>


@dataclass(frozen=True)
class SessionPlan:
    prime_ids: list[int]  # system + user turn 1 up to the end of the context
    questions: list[Question]


def _encode(tok: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def plan_session(tok: Any, session: Session) -> SessionPlan:
    """Token ids of the priming request and of every teacher-forced question (reference answers
    as the history, so every configuration sees the same prompts)."""
    gold = [t.answer or "" for t in session.turns]
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    questions = []
    for k in range(len(session.turns)):
        msgs = session.messages(k, gold)
        prompt = _encode(tok, msgs, True)
        full = _encode(tok, [*msgs, {"role": "assistant", "content": gold[k]}], False)
        if full[:len(prompt)] != prompt or end_id not in full[len(prompt):]:
            raise ValueError(f"session {session.id} turn {k}: the answer does not extend the prompt")
        stop = full.index(end_id, len(prompt)) + 1
        questions.append(Question(session.id, k, session.task, full, len(prompt),
                                  full[len(prompt):stop]))
    first = _encode(tok, session.messages(0, gold), True)
    text = tok.apply_chat_template(session.messages(0, gold), tokenize=False,
                                   add_generation_prompt=True)
    head = tok.encode(text[:text.index(session.context) + len(session.context)],
                      add_special_tokens=False)
    common = next((i for i, (a, b) in enumerate(zip(head, first, strict=False)) if a != b),
                  min(len(head), len(first)))
    return SessionPlan(first[:common], questions)


# ---- requests --------------------------------------------------------------------------------


def post(base_url: str, body: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
    req = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def prime(base_url: str, plan: SessionPlan) -> None:
    """Prefill the context alone; when the request finishes its pages are sealed and cached."""
    post(base_url, {"input_ids": plan.prime_ids,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}})


def score_question(base_url: str, q: Question, top_k: int, ref: dict[str, Any] | None) -> dict[str, Any]:
    """One teacher-forced request. Entry j of input_*_logprobs is the distribution over token
    logprob_start_len + j, so starting one before the answer, entries 1..m cover the targets."""
    body: dict[str, Any] = {
        "input_ids": q.input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": q.answer_start - 1, "top_logprobs_num": top_k}
    if ref is not None:
        body["token_ids_logprob"] = sorted({t for pos in ref["ref_top"] for t, _ in pos})
    meta = post(base_url, body)["meta_info"]
    m = len(q.targets)
    tops = [[(int(t), float(lp)) for lp, t, _ in meta["input_top_logprobs"][j]] for j in range(1, m + 1)]
    record = {"session": q.session, "turn": q.turn, "task": q.task, "answer_tokens": m,
              "cached_tokens": int(meta.get("cached_tokens", 0)),
              "top1": [max(top, key=lambda x: x[1])[0] == t for top, t in zip(tops, q.targets, strict=True)]}
    record["exact"] = all(record["top1"])
    if ref is None:  # the reference run keeps its top-K for the others
        record["ref_top"] = [[[t, lp] for t, lp in top] for top in tops]
        record["kl_tokens"] = [0.0] * m
    else:
        cfg = [{int(t): float(lp) for lp, t, _ in meta["input_token_ids_logprobs"][j]}
               for j in range(1, m + 1)]
        record["kl_tokens"] = [kl_topk([lp for _, lp in pos], [c[t] for t, _ in pos])
                               for pos, c in zip(ref["ref_top"], cfg, strict=True)]
    record["kl"] = sum(record["kl_tokens"]) / m
    return record


def evaluate(base_url: str, plans: list[SessionPlan], top_k: int,
             ref: dict[tuple[int, int], dict[str, Any]] | None, label: str) -> list[dict[str, Any]]:
    """Prime and score every session in order, printing progress."""
    records, t0 = [], time.monotonic()
    for i, plan in enumerate(plans, start=1):
        prime(base_url, plan)
        for q in plan.questions:
            records.append(score_question(base_url, q, top_k, None if ref is None else ref[q.session, q.turn]))
        done = records[-len(plan.questions):]
        print(f"    {label}: session {i}/{len(plans)} ({plan.questions[0].task}) "
              f"exact {sum(r['exact'] for r in done)}/{len(done)}, "
              f"KL {sum(r['kl'] for r in done) / len(done):.4f}, {time.monotonic() - t0:.0f} s",
              flush=True)
    return records


# ---- summary ---------------------------------------------------------------------------------


def summarize(config: Config, records: list[dict[str, Any]], kv_bytes: float) -> dict[str, Any]:
    acc = binomial_se(sum(r["exact"] for r in records), len(records))
    kl = mean_se([r["kl"] for r in records])
    by_task = {t: binomial_se(sum(r["exact"] for r in rs), len(rs))._asdict()
               for t in SCORED_TASKS if (rs := [r for r in records if r["task"] == t])}
    return {**asdict(config), "bytes": kv_bytes, "exact": acc._asdict(), "kl": kl._asdict(), "exact_by_task": by_task,
            "token_acc": mean_se([sum(r["top1"]) / len(r["top1"]) for r in records])._asdict(),
            "kl_token_mean": mean_se([x for r in records for x in r["kl_tokens"]]).mean}


def comparisons(configs: list[Config], records: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """static vs dynamic (same scorer and rho) and static vs uniform (same rho); static-mean
    (equal memory) vs uniform, dynamic and static; kvcompose and baklava (equal memory) vs
    uniform and static-mean; paired over the same questions."""
    by_name = {c.name: c for c in configs if c.name in records}
    versus = {"static": ("dynamic-{s}@{r}", "uniform@{r}"),
              "static-mean": ("uniform@{r}", "dynamic-{s}@{r}", "static-{s}@{r}"),
              **{source: ("uniform@{r}", "static-mean-{s}@{r}") for source in other_sources()},
              "tiers": ("uniform@{r}",)}
    pairs = []
    for c in by_name.values():
        for other in versus.get(c.kind, ()):
            other = other.format(s=c.scorer, r=c.rho)
            if other in by_name:
                pairs.append((c.name, other))
    out = []
    for a, b in pairs:
        ra, rb = records[a], records[b]
        key = [(r["session"], r["turn"]) for r in ra]
        if key != [(r["session"], r["turn"]) for r in rb]:
            raise ValueError(f"{a} and {b} were run on different questions; rerun without --resume")
        d_acc = paired_diff([float(r["exact"]) for r in ra], [float(r["exact"]) for r in rb])
        d_tok = paired_diff([sum(r["top1"]) / len(r["top1"]) for r in ra],
                            [sum(r["top1"]) / len(r["top1"]) for r in rb])
        d_kl = paired_diff([r["kl"] for r in ra], [r["kl"] for r in rb])
        out.append({"a": a, "b": b, "rho": by_name[a].rho,
                    **{f"exact_{k}": v for k, v in d_acc._asdict().items()},
                    "exact_z": d_acc.z, "exact_exceeds_se": d_acc.exceeds_se,
                    "top1_mean": d_tok.mean, "top1_se": d_tok.se, "top1_z": d_tok.z,
                    **{f"kl_{k}": v for k, v in d_kl._asdict().items()},
                    "kl_z": d_kl.z, "kl_exceeds_se": d_kl.exceeds_se, "kl_exceeds_2se": d_kl.exceeds_2se})
    return out


def _flag(z: float) -> str:
    if abs(z) > 2:
        return f"yes, >2 SE (z={z:+.1f})"
    if abs(z) > 1:
        return f"yes, >1 SE (z={z:+.1f})"
    return "no" if math.isnan(z) else f"no (z={z:+.1f})"


def markdown(summaries: list[dict[str, Any]], comps: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"{meta['questions']} questions ({meta['sessions']} sessions x {meta['turns']} turns, "
             f"tasks {', '.join(meta['tasks'])}, ~{meta['context_tokens']}-token contexts, seed "
             f"{meta['seed']}); KL over the top-{meta['top_k']} tokens of full + rest bucket; "
             "mean ± standard error.", "",
             "| config | rho | KV bytes (vs bf16) | exact match | answer-token top-1 | "
             "mean KL(full ‖ config) (nats/token) |",
             "|---|---|---|---|---|---|"]
    for s in summaries:
        e, t, k = s["exact"], s["token_acc"], s["kl"]
        lines.append(f"| {s['name']} | {s['rho']} | {s['bytes']:.3f} | {e['mean']:.3f} ± {e['se']:.3f} | "
                     f"{t['mean']:.3f} ± {t['se']:.3f} | {k['mean']:.4f} ± {k['se']:.4f} |")
    lines += ["", "Paired differences (a − b over the same questions; SE of the per-question "
              "differences; flag: does |Δ| exceed its SE):", "",
              "| rho | a | b | Δ exact | exceeds SE? | Δ top-1 | exceeds SE? | Δ KL | exceeds SE? |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in comps:
        lines.append(f"| {c['rho']} | {c['a']} | {c['b']} | {c['exact_mean']:+.3f} ± {c['exact_se']:.3f} | "
                     f"{_flag(c['exact_z'])} | {c['top1_mean']:+.3f} ± {c['top1_se']:.3f} | "
                     f"{_flag(c['top1_z'])} | {c['kl_mean']:+.4f} ± {c['kl_se']:.4f} | {_flag(c['kl_z'])} |")
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    plot_kl(summaries, path, "bytes", "KV bytes per token (fraction of full bf16)",
            "Next-token KL vs full KV (answer tokens, teacher-forced)", full_at=1.0)


def plot_kl(rows: list[dict[str, Any]], path: Path, x: str, xlabel: str, title: str,
            full_at: float | None = None) -> None:  # fmt: skip
    """Mean KL ± SE of each configuration family (the name before "@") against ``rows[i][x]``;
    ``full_at`` ends every line at the full cache's point (full_at, 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] != FULL:
            families.setdefault(r["name"].split("@")[0], []).append(r)
    tail = [] if full_at is None else [(full_at, 0.0, 0.0)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (name, rs) in enumerate(sorted(families.items())):
        points = sorted((r[x], r["kl"]["mean"], r["kl"]["se"]) for r in rs) + tail
        xs, ys, es = zip(*points, strict=True)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name, color=colors[i % len(colors)])
    # KL spans orders of magnitude (0 for the full cache): linear below 1e-3, log above.
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean KL(full || config), nats/token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- driver ----------------------------------------------------------------------------------


def server_args(model: str, args: argparse.Namespace) -> list[str]:
    return ["--model-path", model, "--device", "cpu", "--dtype", args.dtype,
            "--max-total-tokens", str(args.max_total_tokens), "--page-size", "64",
            "--chunked-prefill-size", "256"]


def run_one(config: Config, model: str, args: argparse.Namespace, plans: list[SessionPlan],
            ref: dict[tuple[int, int], dict[str, Any]] | None) -> tuple[list[dict[str, Any]], float]:
    """Evaluate one configuration on --base-url or on a fresh server; returns records and the
    server's startup seconds."""
    if args.base_url:
        return evaluate(args.base_url, plans, args.top_k, ref, config.name), 0.0
    from sgl_ragged.testing.server import ServerProcess

    log = args.out / "logs" / f"{config.name}.log"
    with ServerProcess([*server_args(model, args), *config.server_args()], log_path=log) as server:
        print(f"    server up in {server.startup_seconds:.0f} s (log {log})", flush=True)
        return evaluate(server.base_url, plans, args.top_k, ref, config.name), server.startup_seconds or 0.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rho", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    p.add_argument("--scorer", nargs="+", default=["snapkv", "expected_attention"])
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="calibrated profiles <scorer>-rho<rho>.json (default calib_profiles/<model>)")
    p.add_argument("--precision", nargs="*", default=[],
                   help="also row tiers at these low precisions (int8 int4 int2 fp8): p@rho per rho "
                        "and p-all (every token at p)")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--only", nargs="+", default=None, help="run only these config names")
    p.add_argument("--base-url", default=None, help="evaluate this running server as --config")
    p.add_argument("--config", default=None, help="the config name of --base-url's server")
    p.add_argument("--resume", action="store_true", help="skip configs whose raw file matches")
    p.add_argument("--deadline-min", type=float, default=None,
                   help="start no further config after this many minutes (the report covers the done ones)")
    p.add_argument("--out", type=Path, default=Path("results/accuracy"))
    args = p.parse_args()
    if args.base_url and not args.config:
        p.error("--base-url needs --config NAME (full first: the others need its top-K)")
    return args


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from sgl_ragged.models.smollm2 import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    profile_dir = args.profile_dir or Path("calib_profiles") / Path(model).name.lower()
    if any(MIXED_SEP in p for p in args.precision):
        raise SystemExit(f"--precision {args.precision}: pairs such as int8{MIXED_SEP}int4 (a quantized "
                         "high tier) are offline only (python -m bench.offline_loss); the server "
                         "stores its high tier at the model dtype")
    configs, missing = plan_configs(args.rho, args.scorer, profile_dir, args.precision)
    if args.base_url or args.only:
        wanted = {args.config} if args.base_url else set(args.only)
        configs = [c for c in configs if c.name in wanted or (c.name == FULL and not args.base_url)]
    for path in missing:
        print(f"missing calibrated profile (skipped): {path}", flush=True)

    wl = WorkloadConfig(sessions=args.sessions, turns=args.turns, context_tokens=args.context_tokens,
                        tasks=SCORED_TASKS, seed=args.seed)
    tok = AutoTokenizer.from_pretrained(model)
    plans = [plan_session(tok, s) for s in build_sessions(wl, local_counter(model))]
    meta = {"model": model, "sessions": wl.sessions, "turns": wl.turns, "tasks": list(wl.tasks),
            "context_tokens": wl.context_tokens, "seed": wl.seed, "top_k": args.top_k,
            "dtype": args.dtype, "questions": sum(len(p.questions) for p in plans),
            "prime_tokens_mean": sum(len(p.prime_ids) for p in plans) / len(plans)}
    raw_dir = args.out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    print(f"{meta['questions']} questions, contexts ~{meta['prime_tokens_mean']:.0f} tokens, "
          f"{len(configs)} configs", flush=True)

    t_start, records, timings = time.monotonic(), {}, {}
    for i, config in enumerate(configs, start=1):
        raw = raw_dir / f"{config.name}.json"
        if (args.resume or args.base_url) and raw.is_file():
            saved = json.loads(raw.read_text())
            if saved["meta"] == meta and (args.resume or config.name != args.config):
                records[config.name] = saved["records"]
                if "timing" in saved:
                    timings[config.name] = saved["timing"]
                print(f"[{i}/{len(configs)}] {config.name}: kept {raw}", flush=True)
                continue
        if args.deadline_min is not None and time.monotonic() - t_start > 60 * args.deadline_min:
            print(f"[{i}/{len(configs)}] {config.name}: skipped, past --deadline-min", flush=True)
            continue
        ref = None
        if config.name != FULL:
            ref_path = raw_dir / f"{FULL}.json"
            if FULL not in records and ref_path.is_file():
                records[FULL] = json.loads(ref_path.read_text())["records"]
            ref = {(r["session"], r["turn"]): r for r in records[FULL]}
        print(f"[{i}/{len(configs)}] {config.name} (--ragged-profile {config.profile} "
              f"--ragged-scorer {config.scorer} --ragged-precision {config.precision}), "
              f"{time.monotonic() - t_start:.0f} s elapsed", flush=True)
        t0 = time.monotonic()
        recs, startup = run_one(config, model, args, plans, ref)
        timings[config.name] = {"startup_s": startup, "eval_s": time.monotonic() - t0 - startup}
        records[config.name] = recs
        raw.write_text(json.dumps({"meta": meta, "config": asdict(config),
                                   "timing": timings[config.name], "records": recs}))

    done = [c for c in plan_configs(args.rho, args.scorer, profile_dir, args.precision)[0]
            if c.name in records]
    from sgl_ragged.profile import model_shape

    shape = model_shape(model)
    summaries = [summarize(c, records[c.name], config_bytes(c, shape)) for c in done]
    comps = comparisons(done, records)
    result = {"meta": meta, "missing_profiles": missing, "timings": timings,
              "wall_s": time.monotonic() - t_start, "configs": summaries, "comparisons": comps}
    (args.out / "accuracy.json").write_text(json.dumps(result, indent=2))
    table = markdown(summaries, comps, meta)
    (args.out / "accuracy.md").write_text(table)
    plot(summaries, args.out / "kl_vs_rho.png")
    print(table)
    print(f"wrote {args.out}/accuracy.json, accuracy.md, kl_vs_rho.png "
          f"({time.monotonic() - t_start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
