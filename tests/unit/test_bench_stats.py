"""Arithmetic of the multi-turn harness (bench/stats.py, bench/client.py, bench/report.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time

import numpy as np
import pytest

from bench import multiturn, report
from bench.client import RequestRecord, _absorb, parse_metrics
from bench.stats import accuracy, hit_rate, peak_overlap, percentile, ratios, summarize


def rec(session: int, turn: int, start: float, first: float, done: float, *, prompt: int = 100,
        cached: int = 0, out: int = 5, task: str = "kv", text: str = "", expected: str | None = None,
        error: str | None = None) -> RequestRecord:
    return RequestRecord(session, turn, task, start, first, done, prompt, cached, out, text,
                         expected, error)


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases():
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0


def test_record_times():
    r = rec(0, 0, start=1.0, first=1.5, done=3.5, out=5)
    assert r.ttft == 0.5 and r.latency == 2.5 and r.tpot == pytest.approx(0.5)
    assert rec(0, 0, 1.0, 1.5, 2.0, out=1).tpot is None


def test_hit_rate_is_cached_over_prompt_tokens():
    rs = [rec(0, 0, 0, 1, 2, prompt=1000, cached=0), rec(0, 1, 2, 3, 4, prompt=1100, cached=960),
          rec(1, 0, 0, 1, 2, prompt=900, cached=640)]
    assert hit_rate(rs) == pytest.approx(1600 / 3000)
    assert math.isnan(hit_rate([]))


def test_accuracy_per_task():
    rs = [rec(0, 0, 0, 1, 2, task="kv", text="abc-123", expected="ABC-123"),
          rec(0, 1, 0, 1, 2, task="kv", text="The value is abc-123.", expected="abc-123"),
          rec(1, 0, 0, 1, 2, task="code", text="42", expected="4821"),
          rec(2, 0, 0, 1, 2, task="chat", text="hello"),  # not scored
          rec(3, 0, 0, 1, 2, task="code", text="", expected="1", error="HTTP 500")]  # failed
    assert accuracy(rs) == {"code": {"exact": 0.0, "contains": 0.0, "n": 1},
                            "kv": {"exact": 0.5, "contains": 1.0, "n": 2}}


def test_peak_overlap():
    assert peak_overlap([(0, 2), (1, 3), (2, 4), (5, 6)]) == 2  # touching intervals do not overlap
    assert peak_overlap([(0, 10), (1, 2), (1, 3)]) == 3
    assert peak_overlap([]) == 0


def test_summarize_throughput_and_latencies():
    rs = [rec(0, 0, start=0.0, first=1.0, done=2.0, out=11, prompt=100),
          rec(0, 1, start=2.0, first=2.5, done=4.0, out=4, prompt=150, cached=64),
          rec(1, 0, start=0.0, first=0.5, done=1.0, out=1, prompt=80, error="boom")]
    samples = [{"t": 0.5, "running": 1, "token_usage": 0.1}, {"t": 1.0, "running": 2, "token_usage": 0.3}]
    s = summarize(rs, samples)
    assert s["requests"] == 3 and s["errors"] == 1 and s["duration_s"] == 4.0
    assert s["requests_per_s"] == 0.5 and s["output_tokens_per_s"] == 15 / 4
    assert s["ttft_p50_ms"] == pytest.approx(750) and s["ttft_p99_ms"] == pytest.approx(995)
    assert s["tpot_p50_ms"] == pytest.approx((100 + 500) / 2)
    assert s["prefix_hit_rate"] == pytest.approx(64 / 250)
    assert s["prefix_hit_rate_later_turns"] == pytest.approx(64 / 150)
    assert s["peak_running"] == 2 and s["peak_token_usage"] == 0.3 and s["peak_inflight"] == 1


def test_ratios_of_two_runs():
    run = {"requests_per_s": 3.0, "ttft_p50_ms": 50.0, "prefix_hit_rate": 0.6,
           "max_total_num_tokens": 48512, "accuracy": {}}
    ref = {"requests_per_s": 1.5, "ttft_p50_ms": 100.0, "prefix_hit_rate": 0.0,
           "max_total_num_tokens": 16384}
    r = ratios(run, ref)
    assert r["requests_per_s"] == 2.0 and r["ttft_p50_ms"] == 0.5
    assert math.isnan(r["prefix_hit_rate"]) and r["max_total_num_tokens"] == pytest.approx(2.961, abs=1e-3)
    assert "accuracy" not in r and "tpot_p50_ms" not in r


def test_sse_chunks_fill_the_record():
    r = RequestRecord(0, 0, "kv", start=1.0)
    pieces: list[str] = []
    _absorb({"choices": [{"delta": {"role": "assistant"}}]}, r, pieces, 1.2)
    assert r.first_token_at is None  # a role-only delta is not a token
    _absorb({"choices": [{"delta": {"content": "Hel"}}]}, r, pieces, 1.4)
    _absorb({"choices": [{"delta": {"content": "lo"}}]}, r, pieces, 1.6)
    _absorb({"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 256}}}, r, pieces, 1.7)
    assert r.first_token_at == 1.4 and "".join(pieces) == "Hello"
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (300, 2, 256)


def test_parse_metrics_sums_label_sets():
    text = "\n".join([
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 3.0',
        'sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1"} 1.0',
        'sglang:token_usage{model_name="m"} 0.25',
        'sglang:num_running_reqs_total{model_name="m"} 99.0',
        "sglang:num_queue_reqs 2",
    ])
    assert parse_metrics(text) == {"running": 4.0, "token_usage": 0.25, "queued": 2.0}


def _run(label: str, rate: float | None, rps: float, rho: float) -> dict:
    summary = {"requests_per_s": rps, "output_tokens_per_s": rps * 10, "prefix_hit_rate": 0.5,
               "peak_running": 2.0, "peak_token_usage": 0.4, "max_total_num_tokens": 1000,
               "errors": 0, "accuracy": {"kv": {"exact": 0.0, "contains": 0.5, "n": 2}},
               **{f"{m}_p{q}_ms": 100.0 / rps for m in ("ttft", "tpot") for q in (50, 90, 99)}}
    return {"label": label, "request_rate": rate, "summary": summary,
            "timeline": [{"t": 0.0, "running": 1.0, "token_usage": 0.1}],
            "budget": {"kv_tokens": 1000, "rho": rho, "retention": rho}}


def test_report_ratios_against_baseline_per_rate(tmp_path):
    runs = [_run("ragged:uniform:0.3", None, 2.0, 0.3), _run("baseline", None, 1.0, 1.0),
            _run("ragged:uniform:0.3", 0.5, 0.4, 0.3), _run("baseline", 0.5, 0.5, 1.0),
            _run("ragged:uniform:0.5", 0.5, 0.45, 0.5), _run("baseline", 1.0, 0.8, 1.0)]
    result = report.build(runs, workload={"seed": 0}, argv=["--launch", "baseline"])
    pairs = {(p["run"], p["request_rate"]): p for p in result["ratios"]}
    assert set(pairs) == {("ragged:uniform:0.3", None), ("ragged:uniform:0.3", 0.5),
                          ("ragged:uniform:0.5", 0.5)}
    assert pairs["ragged:uniform:0.3", None]["requests_per_s"] == 2.0
    assert pairs["ragged:uniform:0.3", 0.5]["requests_per_s"] == pytest.approx(0.8)
    assert all(p["reference"] == "baseline" for p in pairs.values())
    table = report.write(result, tmp_path)
    assert json.loads((tmp_path / "multiturn.json").read_text())["runs"][0]["request_rate"] is None
    assert (tmp_path / "multiturn.md").read_text().strip() == table
    assert "| ragged:uniform:0.3 / baseline | max | 2.00 |" in table and "kv 0.50" in table
    for png in ("throughput_vs_rho.png", "ttft_vs_rate.png", "kv_usage.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_nan_is_null_and_na(tmp_path):
    run = _run("server", None, 1.0, 1.0)
    run["summary"]["peak_running"] = math.nan
    run.pop("budget")
    result = report.build([run], workload={}, argv=[])
    table = report.write(result, tmp_path, plots=False)
    assert result["ratios"] == [] and "n/a" in table
    assert json.loads((tmp_path / "multiturn.json").read_text())["runs"][0]["summary"]["peak_running"] is None


def test_poisson_arrivals_are_seeded_with_the_requested_mean_gap():
    def release_times(seed: int) -> list[float]:
        arrivals = multiturn.Arrivals(rate=10.0, seed=seed)
        times = []

        async def take() -> None:
            for _ in range(2000):  # t0 long past: no sleeping
                await arrivals.wait(t0=time.perf_counter() - 1e6)
                times.append(arrivals.next_at)

        asyncio.run(take())
        return times

    a = release_times(0)
    assert a == release_times(0) and a != release_times(1)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / len(a) == pytest.approx(0.1, rel=0.1)


def test_load_config_checks():
    with pytest.raises(ValueError, match="request-rate"):
        multiturn.LoadConfig(request_rate=0.0)
    with pytest.raises(ValueError, match="concurrency"):
        multiturn.LoadConfig(concurrency=0)


def test_throughput_plot_with_equal_rho(tmp_path):
    """A calibrated and a uniform profile at the same rho must not break the plot's ordering."""
    runs = [_run("baseline", None, 1.0, 1.0), _run("ragged:a", None, 2.0, 0.3),
            _run("ragged:b", None, 1.5, 0.3)]
    assert report.plot_throughput_vs_rho(runs, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
