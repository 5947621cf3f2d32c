"""bench.sglang_serving without servers: its arguments, its plan at equal bytes, one run's
plumbing through a stand-in for sglang.bench_serving, and the medians it reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import sglang_serving

PROFILE = "calib_profiles/smollm2-135m-instruct/mixed-uniform-rho0.3.json"


def test_the_default_workload_is_multi_turn_chat_and_words_after_the_dashes_replace_it() -> None:
    args, workload = sglang_serving.parse_args(["--base-url", "http://x:1"])
    assert workload == list(sglang_serving.DEFAULT_WORKLOAD)
    assert workload[workload.index("--gsp-num-turns") + 1] == "3"
    command = sglang_serving.bench_command("http://x:1", "/m", workload, Path("/o.jsonl"), 7)
    assert command[1:3] == ["-m", "sglang.bench_serving"]
    assert command[command.index("--backend") + 1] == "sglang-oai-chat"  # multi-turn needs chat
    assert "--flush-cache" in command and command[command.index("--seed") + 1] == "7"
    _, workload = sglang_serving.parse_args(["--base-url", "http://x:1", "--",
                                             "--dataset-name", "random-ids"])
    assert workload == ["--dataset-name", "random-ids"]


@pytest.mark.parametrize("argv, message", [
    ([], "either --base-url or at least one --launch"),
    (["--base-url", "http://x:1", "--launch", "baseline"], "either --base-url"),
    (["--launch", "baseline", "--rounds", "0"], "--rounds must be at least 1"),
    (["--launch", "router:2:round_robin:baseline"], "bench.multiturn's"),
    (["--base-url", "http://x:1", "--", "--port", "1"], "--port after -- is set by this"),
])
def test_bad_arguments_say_what_to_do(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        sglang_serving.parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_plan_gives_each_server_the_same_bytes(model_path: str) -> None:
    plan = sglang_serving.main(["--launch", "baseline", "--launch", f"ragged@mixed:{PROFILE}",
                                "--model", model_path, "--kv-budget-tokens", "8192",
                                "--dry-run"])
    stock, ragged = plan["targets"]
    assert stock["budget"]["kv_tokens"] == 8192
    # 0.312 of the bytes a token (3.2x the tokens), less the staging pages of 16 running
    # requests, which take a good part of so small a budget
    assert 2 * 8192 < ragged["budget"]["kv_tokens"] < 8192 / 0.312
    for target in plan["targets"]:
        args = target["launch_args"]
        assert "--enable-metrics" in args and args[args.index("--max-total-tokens") + 1] == str(
            target["budget"]["kv_tokens"])
    assert plan["bench_serving"][plan["bench_serving"].index("--model") + 1] == model_path


def _fake_bench_serving(tmp_path: Path, result: dict | None, code: int = 0) -> Path:
    """A stand-in for `python -m sglang.bench_serving`: prints a line, appends `result` to its
    --output-file, exits with `code`."""
    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import json, sys\n"
        "argv = sys.argv\n"
        "print('fake bench_serving', ' '.join(argv[1:]))\n"
        f"result = {json.dumps(result)!r}\n"
        "if result != 'null':\n"
        "    with open(argv[argv.index('--output-file') + 1], 'a') as f:\n"
        "        f.write(result + '\\n')\n"
        f"sys.exit({code})\n")
    return script


def test_one_run_keeps_the_tools_result_and_its_output(tmp_path: Path, monkeypatch) -> None:
    result = {"completed": 6, "duration": 3.0, "request_throughput": 2.0, "median_ttft_ms": 500.0,
              "extra_field": 1}
    script = _fake_bench_serving(tmp_path, result)
    real = sglang_serving.bench_command
    monkeypatch.setattr(sglang_serving, "bench_command", lambda *a: [
        sys.executable, str(script), *real(*a)[3:]])
    log = tmp_path / "logs" / "x.txt"
    # nothing listens there: no counters, the run itself goes on
    run = sglang_serving.run_one("http://127.0.0.1:9", "x", "/m", ["--num-prompts", "6"], 1, log)
    assert run["label"] == "x" and run["completed"] == 6 and run["request_throughput"] == 2.0
    assert run["p99_ttft_ms"] is None and "extra_field" not in run and run["counters"] is None
    text = log.read_text()
    assert "--num-prompts 6" in text.splitlines()[0] and "fake bench_serving" in text


def test_a_failed_run_names_its_log(tmp_path: Path, monkeypatch) -> None:
    script = _fake_bench_serving(tmp_path, None, code=3)
    monkeypatch.setattr(sglang_serving, "bench_command", lambda *a: [sys.executable, str(script)])
    with pytest.raises(RuntimeError, match=r"exited with 3; its output is in .*y\.txt"):
        sglang_serving.run_one("http://127.0.0.1:9", "y", "/m", [], 1, tmp_path / "y.txt")


def test_counters_are_read_from_metrics_text() -> None:
    text = ("# HELP x\nsglang:prompt_tokens_total{a=\"1\"} 100.0\nsglang:prompt_tokens_total{a=\"2\"} 20.0\n"
            "sglang:cached_tokens_total{a=\"1\"} 60.0\nsglang:num_retracted_requests_total 2.0\n")
    got = sglang_serving.parse_server_counters(text)
    assert got["prompt_tokens"] == 120 and got["cached_tokens"] == 60 and got["retracted"] == 2
    assert sglang_serving.parse_server_counters("no metrics here") is None


def _run(label: str, rate: float, round_: int, cached: int = 50) -> dict:
    fields = dict.fromkeys(sglang_serving.FIELDS, 1.0)
    return {**fields, "label": label, "request_throughput": rate, "round": round_,
            "counters": {"prompt_tokens": 100, "cached_tokens": cached, "retracted": 1}}


def test_the_summary_takes_medians_over_rounds_and_ratios_to_the_first_server() -> None:
    runs = [_run("stock", 0.1, 0), _run("ragged", 0.4, 0, 80), _run("ragged", 0.2, 1, 60),
            _run("stock", 0.3, 1)]
    rows = sglang_serving.summarize(runs, ["stock", "ragged", "never ran"])
    assert [r["label"] for r in rows] == ["stock", "ragged"]
    stock, ragged = rows
    assert stock["request_throughput"] == pytest.approx(0.2)
    assert ragged["request_throughput_each"] == [0.4, 0.2] and ragged["ratio"] == pytest.approx(1.5)
    assert ragged["cached_share"] == pytest.approx(0.7) and ragged["retracted"] == 2
    result = {"targets": [{"label": "ragged", "budget": {"kv_tokens": 18688}}], "summary": rows,
              "failed": [{"label": "fp8", "error": "ServerError: no"}]}
    table = sglang_serving.markdown(result)
    assert "| ragged | 18688 | 0.400, 0.200 | 0.300 | x1.50 |" in table
    assert "| 70% | 2 |" in table and "| fp8 | FAILED: ServerError: no |" in table
