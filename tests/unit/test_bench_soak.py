"""bench.counters and bench.soak without a server: counter parsing and the soak's verdict."""

from __future__ import annotations

from bench.counters import delta, parse_counters
from bench.soak import markdown, problems

METRICS = """# HELP sglang:num_requests_total Number of requests processed.
sglang:num_requests_total{is_streaming="false",model_name="m"} 3.0
sglang:num_requests_total{is_streaming="true",model_name="m"} 4.0
sglang:evicted_tokens_total{model_name="m"} 128.0
sglang:ragged_integrity_checks_total 17.0
sglang:num_requests_created 9.0
"""


def test_counters_sum_label_sets_and_default_to_zero():
    got = parse_counters(METRICS)
    assert got["requests"] == 7.0 and got["evicted_tokens"] == 128.0
    assert got["integrity_checks"] == 17.0
    assert got["retracted"] == 0.0 and got["integrity_violations"] == 0.0
    assert delta(got, {**got, "requests": 10.0})["requests"] == 3


def _report(**changes):
    server = {"requests": 4, "aborted": 1, "retracted": 1, "evicted_tokens": 64, "pages_sealed": 5,
              "integrity_checks": 10, "integrity_violations": 0}
    report = {"config": {"sessions": 2, "turns": 2, "concurrency": 2}, "seconds": 3.0,
              "client": {"sent": 4, "completed": 3, "aborted": 1, "errors": []},
              "server": server, "evicted_pages": 1, "max_total_tokens": 4096,
              "free_tokens_idle": 4096, "free_tokens_after": 4096, "answer_after": "Paris."}
    for key, value in changes.items():
        (server if key in server else report)[key] = value
    return report


def test_an_intact_run_passes():
    report = _report()
    assert problems(report) == []
    report["problems"] = []
    assert "all checks passed" in markdown(report) and "| 10 / 0 |" in markdown(report)


def test_each_failure_is_named():
    assert "integrity violations" in problems(_report(integrity_violations=2))[0]
    assert "no integrity check ran" in problems(_report(integrity_checks=0))[0]
    assert "free tokens after the run 4032 != idle 4096" in problems(_report(free_tokens_after=4032))[0]
    assert "no answer" in problems(_report(answer_after=""))[0]
    failed = _report()
    failed["client"]["errors"] = ["HTTP 500: boom"]
    assert "1 client errors, first: HTTP 500: boom" in problems(failed)[0]
