"""Outputs of the multi-turn benchmark: multiturn.json, a markdown table, PNG plots.

Ratios compare each run with the reference at the same request rate (and round, with
`--rounds`): the `baseline` run if there is one, else that of the target that ran first. With rounds, a
third table gives each target's medians over them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.stats import ratios


def _rate(run: dict[str, Any]) -> float:
    """The run's Poisson rate; inf for an unpaced run (stored as null)."""
    return math.inf if run["request_rate"] is None else float(run["request_rate"])


def _reference(runs: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any] | None:
    """`run`'s reference: at its rate and in its round, the baseline's run, else that of the
    target that ran first at that rate (the first --launch: rounds reverse the order); None
    where that target has no run in `run`'s round (its server failed before it)."""
    same = [r for r in runs if _rate(r) == _rate(run)]
    first = next((r["label"] for r in same if r["label"] == "baseline"), same[0]["label"])
    return next((r for r in same if r["label"] == first and r.get("round") == run.get("round")),
                None)


def build(runs: list[dict[str, Any]], failed: list[dict[str, Any]] | None = None, *,
          workload: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """The JSON document: workload, command line, runs and their ratios to the reference, and
    the launched targets that failed ({"label", "launch_args", "error"})."""
    pairs = []
    for run in runs:
        ref = _reference(runs, run)
        if ref is not None and ref is not run:
            pairs.append({"run": run["label"], "reference": ref["label"],
                          "request_rate": run["request_rate"],
                          **({"round": run["round"]} if "round" in run else {}),
                          **ratios(run["summary"], ref["summary"])})
    result = {"workload": workload, "argv": argv, "runs": runs, "ratios": pairs,
              "failed": list(failed or [])}
    return {**result, "medians": medians(result)}


def _round_text(item: dict[str, Any]) -> str:
    return f" (round {item['round'] + 1})" if "round" in item else ""


def _median(values: list[Any]) -> float:
    return statistics.median(values) if values and None not in values else math.nan


def medians(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each (target, rate)'s medians over its rounds: req/s, TTFT p50, prefix hit rate, and the
    median over rounds of its req/s ratio to that round's reference (empty without rounds)."""
    runs = [r for r in result["runs"] if "round" in r]
    out = []
    for label, rate in dict.fromkeys((r["label"], _rate(r)) for r in runs):
        mine = [r["summary"] for r in runs if r["label"] == label and _rate(r) == rate]
        ratio = [p["requests_per_s"] for p in result["ratios"]
                 if p["run"] == label and _rate(p) == rate and "requests_per_s" in p]
        out.append({"label": label, "request_rate": None if math.isinf(rate) else rate,
                    "rounds": len(mine),
                    **{k: _median([s.get(k) for s in mine])
                       for k in ("requests_per_s", "ttft_p50_ms", "prefix_hit_rate")},
                    "requests_per_s_ratio": _median(ratio)})
    return out


def _num(x: Any, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, fmt)


def _rate_text(rate: float) -> str:
    return "max" if math.isinf(rate) else f"{rate:g}"


def _triple(s: dict[str, Any], name: str) -> str:
    return " / ".join(_num(s[f"{name}_p{q}_ms"], ".0f") for q in (50, 90, 99))


def _accuracy(s: dict[str, Any]) -> str:
    return ", ".join(f"{task} {a['contains']:.2f}" for task, a in s["accuracy"].items()) or "n/a"


def markdown(result: dict[str, Any]) -> str:
    """Two tables: one row per run, then the ratios to the reference."""
    lines = ["| run | rate (req/s) | req/s | output tok/s | TTFT p50/p90/p99 (ms) | "
             "TPOT p50/p90/p99 (ms) | prefix hit rate | peak running (server / client) | peak KV usage | "
             "KV tokens | accuracy (contains) | errors |", "|" + "---|" * 12]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(
            f"| {run['label']}{_round_text(run)} | {_rate_text(_rate(run))} | {_num(s['requests_per_s'], '.3f')} | "
            f"{_num(s['output_tokens_per_s'], '.1f')} | {_triple(s, 'ttft')} | "
            f"{_triple(s, 'tpot')} | {_num(s['prefix_hit_rate'], '.3f')} | "
            f"{_num(s['peak_running'], '.0f')} / {s.get('peak_inflight', 'n/a')} | "
            f"{_num(s['peak_token_usage'], '.2f')} | "
            f"{s['max_total_num_tokens'] or 'n/a'} | {_accuracy(s)} | {s['errors']} |")
    if result["ratios"]:
        lines += ["", "| run / reference | rate | req/s | output tok/s | TTFT p50 | TPOT p50 | "
                      "prefix hit rate | KV tokens |", "|" + "---|" * 8]
        for r in result["ratios"]:
            cells = [_num(r.get(k)) for k in ("requests_per_s", "output_tokens_per_s",
                                              "ttft_p50_ms", "tpot_p50_ms", "prefix_hit_rate",
                                              "max_total_num_tokens")]
            lines.append(f"| {r['run']} / {r['reference']}{_round_text(r)} | "
                         f"{_rate_text(_rate(r))} | " + " | ".join(cells) + " |")
    rows = result["medians"]  # build's
    if rows:
        lines += ["", "| median over rounds | rate | rounds | req/s | req/s / reference | "
                      "TTFT p50 (ms) | prefix hit rate |", "|" + "---|" * 7]
        for m in rows:
            lines.append(f"| {m['label']} | {_rate_text(_rate(m))} | {m['rounds']} | "
                         f"{_num(m['requests_per_s'], '.3f')} | {_num(m['requests_per_s_ratio'])} | "
                         f"{_num(m['ttft_p50_ms'], '.0f')} | {_num(m['prefix_hit_rate'], '.3f')} |")
    for f in result.get("failed", []):
        first = (f["error"].strip().splitlines() or [""])[0][:200]
        lines += ["", f"**{f['label']} failed**: {first} (multiturn.json: the whole error; "
                      "logs/: the server's log)"]
    return "\n".join(lines)


def write(result: dict[str, Any], out: Path, plots: bool = True) -> str:
    """multiturn.json, multiturn.md and (if matplotlib imports) the plots; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "multiturn.json").write_text(json.dumps(_strict(result), indent=1, allow_nan=False))
    table = markdown(result)
    (out / "multiturn.md").write_text(table + "\n")
    if plots:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            return table
        plot_throughput_vs_rho(result["runs"], out / "throughput_vs_rho.png")
        plot_ttft_vs_rate(result["runs"], out / "ttft_vs_rate.png")
        plot_kv_usage(result["runs"], out / "kv_usage.png")
    return table


def _strict(x: Any) -> Any:
    """NaN and infinities as null, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def plot_throughput_vs_rho(runs: list[dict[str, Any]], path: Path) -> bool:
    """requests/s and output tokens/s against the target retention, one line per rate."""
    import matplotlib.pyplot as plt

    with_rho = [r for r in runs if r.get("budget")]
    if len({r["budget"]["rho"] for r in with_rho}) < 2:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for rate in sorted({_rate(r) for r in with_rho}):
        pts = sorted(((r["budget"]["rho"], r["summary"]) for r in with_rho if _rate(r) == rate),
                     key=lambda point: point[0])  # equal rho (e.g. uniform vs calibrated) ties
        for ax, key in zip(axes, ("requests_per_s", "output_tokens_per_s"), strict=True):
            ax.plot([p for p, _ in pts], [s[key] for _, s in pts], "o-",
                    label=f"rate {_rate_text(rate)}")
            ax.set_xlabel("rho (1.0 = stock SGLang)")
            ax.set_ylabel(key.replace("_", " "))
    axes[0].legend()
    fig.suptitle("Throughput vs retention at equal KV memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_ttft_vs_rate(runs: list[dict[str, Any]], path: Path) -> bool:
    """TTFT p50 (solid) and p90 (dashed) against the request rate, one colour per server."""
    import matplotlib.pyplot as plt

    finite = [r for r in runs if not math.isinf(_rate(r))]
    if len({_rate(r) for r in finite}) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["label"] for r in finite):
        pts = sorted((_rate(r), r["summary"]) for r in finite if r["label"] == label)
        line, = ax.plot([p for p, _ in pts], [s["ttft_p50_ms"] for _, s in pts], "o-", label=label)
        ax.plot([p for p, _ in pts], [s["ttft_p90_ms"] for _, s in pts], "--",
                color=line.get_color())
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("TTFT (ms), p50 solid, p90 dashed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_kv_usage(runs: list[dict[str, Any]], path: Path) -> bool:
    """KV token usage and running requests over time, one line per run (from /metrics)."""
    import matplotlib.pyplot as plt

    polled = [r for r in runs if r["timeline"]]
    if not polled:
        return False
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in polled:
        t = [s["t"] for s in run["timeline"]]
        name = f"{run['label']} rate {_rate_text(_rate(run))}"
        axes[0].plot(t, [s.get("token_usage", math.nan) for s in run["timeline"]], label=name)
        axes[1].plot(t, [s.get("running", math.nan) for s in run["timeline"]], label=name)
    axes[0].set_ylabel("KV token usage")
    axes[1].set_ylabel("running requests")
    axes[1].set_xlabel("time (s)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
