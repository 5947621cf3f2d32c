"""Tiny runs of the multi-turn benchmarks (bench/multiturn.py, and SGLang's own through
bench/sglang_serving.py) against the ragged server through --base-url: each harness runs end to
end and writes its JSON and markdown."""

from __future__ import annotations

import json

import pytest

from bench import multiturn, sglang_serving

pytestmark = pytest.mark.e2e


def test_tiny_multiturn_run(ragged_server, model_path, tmp_path):
    result = multiturn.main([
        "--base-url", ragged_server.base_url, "--label", "ragged", "--model", model_path,
        "--tasks", "kv,needle", "--sessions", "2", "--turns", "2", "--context-tokens", "300",
        "--max-tokens", "4", "--concurrency", "2", "--out", str(tmp_path), "--no-plots",
    ])
    saved = json.loads((tmp_path / "multiturn.json").read_text())
    assert saved["workload"]["sessions"] == 2 and saved["ratios"] == []
    (run,) = saved["runs"]
    s = run["summary"]
    assert s["requests"] == 4 and s["errors"] == 0
    assert s["output_tokens"] > 0 and s["requests_per_s"] > 0 and s["ttft_p50_ms"] > 0
    assert s["max_total_num_tokens"] == result["runs"][0]["summary"]["max_total_num_tokens"] > 0
    assert set(s["accuracy"]) == {"kv", "needle"}
    later = [r for r in run["requests"] if r["turn"] == 1]
    assert len(later) == 2 and all(r["cached_tokens"] >= 256 for r in later)  # turn 1 re-used
    assert 0 < s["prefix_hit_rate"] < 1 and run["timeline"]  # /metrics was polled
    table = (tmp_path / "multiturn.md").read_text()
    assert table.startswith("| run |") and "| ragged | max |" in table


def test_sglang_bench_serving_runs_against_the_ragged_server(ragged_server, model_path, tmp_path):
    """SGLang's own benchmark (bench/sglang_serving.py): its multi-turn chat dataset served end
    to end, the later turns finding their histories cached."""
    result = sglang_serving.main([
        "--base-url", ragged_server.base_url, "--model", model_path, "--out", str(tmp_path), "--",
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
        "--gsp-prompts-per-group", "1", "--gsp-system-prompt-len", "200", "--gsp-question-len",
        "16", "--gsp-output-len", "4", "--gsp-num-turns", "2", "--max-concurrency", "2",
    ])
    (run,) = result["runs"]
    assert run["completed"] == 4 and run["request_throughput"] > 0 and run["median_ttft_ms"] > 0
    counters = run["counters"]  # the shared server has --enable-metrics
    assert counters["requests"] >= 4 and counters["aborted"] == 0
    assert counters["cached_tokens"] >= 2 * 64  # each second turn re-used its first turn's pages
    saved = json.loads((tmp_path / "sglang_serving.json").read_text())
    assert saved["summary"][0]["request_throughput"] == run["request_throughput"]
    assert (tmp_path / "sglang_serving.md").read_text().startswith("| server |")
