"""A tiny run of the multi-turn benchmark (bench/multiturn.py) against the ragged server
through --base-url: the harness runs end to end and writes its JSON and markdown."""

from __future__ import annotations

import json

import pytest

from bench import multiturn

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
