"""Arithmetic of the multi-turn report: percentiles, throughput, prefix-cache hit rate,
accuracy per task, peak concurrency and the ratios between two runs. Pure functions over
`RequestRecord`s (no server), so unit tests check them directly."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.client import RequestRecord
from bench.workloads import score_answer

QUANTILES = (50, 90, 99)
# Summary keys where a ratio between two runs means something, and whether higher is better.
RATIO_KEYS = {"requests_per_s": True, "output_tokens_per_s": True, "ttft_p50_ms": False,
              "ttft_p90_ms": False, "ttft_p99_ms": False, "tpot_p50_ms": False,
              "tpot_p90_ms": False, "tpot_p99_ms": False, "prefix_hit_rate": True,
              "max_total_num_tokens": True, "peak_running": True}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles_ms(name: str, values: Sequence[float]) -> dict[str, float]:
    """{"<name>_p50_ms": ..., "<name>_p90_ms": ..., "<name>_p99_ms": ...} from seconds."""
    return {f"{name}_p{q}_ms": percentile(values, q) * 1e3 for q in QUANTILES}


def hit_rate(records: Iterable[RequestRecord]) -> float:
    """Cached prompt tokens over all prompt tokens (NaN if no prompt tokens)."""
    rs = list(records)
    prompt = sum(r.prompt_tokens for r in rs)
    return sum(r.cached_tokens for r in rs) / prompt if prompt else math.nan


def accuracy(records: Iterable[RequestRecord]) -> dict[str, dict[str, float]]:
    """Per task with expected answers: {"exact": frac, "contains": frac, "n": count}."""
    by_task: dict[str, list[tuple[bool, bool]]] = {}
    for r in records:
        if r.expected is not None and r.error is None:
            score = score_answer(r.text, r.expected)
            by_task.setdefault(r.task, []).append((score.exact, score.contains))
    return {task: {"exact": sum(e for e, _ in s) / len(s), "contains": sum(c for _, c in s) / len(s),
                   "n": len(s)} for task, s in sorted(by_task.items())}


def peak_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals [start, end) open at one time."""
    spans = list(intervals)
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    peak = now = 0
    for _, delta in events:  # at equal times an end (-1) sorts before a start (+1)
        now += delta
        peak = max(peak, now)
    return peak


def peak(samples: Sequence[dict[str, float]], name: str) -> float:
    """Largest polled value of a /metrics gauge; NaN if it was never seen."""
    return max((s[name] for s in samples if name in s), default=math.nan)


def summarize(records: Sequence[RequestRecord], samples: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The per-run numbers of the report (times in ms, rates per second of wall time)."""
    ok = [r for r in records if r.error is None and r.done_at is not None]
    duration = (max(r.done_at for r in ok) - min(r.start for r in ok)) if ok else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    later = [r for r in ok if r.turn > 0]
    return {
        "requests": len(records), "errors": len(records) - len(ok), "duration_s": duration,
        "requests_per_s": len(ok) / duration if ok and duration > 0 else math.nan,
        "output_tokens_per_s": out_tokens / duration if ok and duration > 0 else math.nan,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        **percentiles_ms("ttft", [t for r in ok if (t := r.ttft) is not None]),
        **percentiles_ms("tpot", [t for r in ok if (t := r.tpot) is not None]),
        **percentiles_ms("latency", [t for r in ok if (t := r.latency) is not None]),
        "prefix_hit_rate": hit_rate(ok), "prefix_hit_rate_later_turns": hit_rate(later),
        "peak_inflight": peak_overlap((r.start, r.done_at) for r in ok if r.done_at is not None),
        "peak_running": peak(samples, "running"),
        "peak_token_usage": peak(samples, "token_usage"),
        "peak_used_tokens": peak(samples, "used_tokens"),
        "accuracy": accuracy(ok),
    }


def ratios(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """run / reference for each RATIO_KEYS entry both have (NaN where the reference is 0)."""
    out = {}
    for key in RATIO_KEYS:
        a, b = run.get(key), reference.get(key)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            out[key] = a / b if b else math.nan
    return out
