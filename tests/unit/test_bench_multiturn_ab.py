"""bench.multiturn's A/B tools: launch_server arguments of one --launch target alone (a flag on
and off in one run), and --rounds (every server up at once, measured in alternating order, the
medians over the rounds in the report)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import multiturn, report
from bench.servers import Target
from tests.unit.fake_deployments import fake_deployments

HOLD = "ragged:uniform:0.3 --ragged-hold-history 2"


def test_words_after_a_target_are_its_own_launch_args(llama_8b_shape: Path,
                                                      tmp_path: Path) -> None:
    args = multiturn.parse_args(["--model", str(llama_8b_shape), "--launch", "ragged:uniform:0.3",
                                 "--launch", HOLD, "--launch", "baseline --schedule-policy=lpm",
                                 "--server-arg=--ragged-window-pages=2", "--out", str(tmp_path)])
    plain, held, stock = multiturn.plan_launches(args, str(llama_8b_shape))
    assert held.target.label == HOLD and held.target.extra == ("--ragged-hold-history", "2")
    assert held.target.profile == "uniform:0.3" and plain.target.extra == ()
    # the target's own words after every launch's, so they win where both give a flag
    assert held.server_args[-3:] == ["--ragged-window-pages=2", "--ragged-hold-history", "2"]
    assert plain.server_args == held.server_args[:-2] and plain.budget == held.budget
    assert stock.target.profile is None and stock.server_args[-1] == "--schedule-policy=lpm"
    assert multiturn._file_name(HOLD) == "ragged_uniform_0.3_--ragged-hold-history_2"


def test_the_last_window_pages_sizes_the_staging_pool(llama_8b_shape: Path,
                                                       tmp_path: Path) -> None:
    """launch_server reads the last --ragged-window-pages; the budget must take out the same
    staging pool (window + 1 pages per running request)."""
    args = multiturn.parse_args(["--model", str(llama_8b_shape), "--out", str(tmp_path),
                                 "--server-arg=--ragged-window-pages=1", "--launch",
                                 "ragged:uniform:0.3", "--launch",
                                 "ragged:uniform:0.3 --ragged-window-pages 8"])
    one, eight = multiturn.plan_launches(args, str(llama_8b_shape))
    assert multiturn._window_pages(["--ragged-window-pages=1", "--ragged-window-pages", "8"]) == 8
    assert eight.budget.kv_tokens < one.budget.kv_tokens


@pytest.mark.parametrize("spec, match", [
    ("ragged:uniform:0.3 lpm", "not 'lpm'"),
    ("ragged:uniform:0.3 '--x", "No closing quotation"),
    ("   ", "give a target"),
    ("ragged --x 1", "use 'baseline'"),
])
def test_bad_launch_specs_say_what_to_write(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Target.parse(spec)


def test_router_targets_take_their_own_args_too() -> None:
    target = Target.parse("router:2:round_robin:ragged:uniform:0.3 --ragged-hold-history 1")
    assert target.workers == 2 and target.policy == "round_robin"
    assert target.extra == ("--ragged-hold-history", "1")
    assert target.label == "router:2:round_robin:ragged:uniform:0.3 --ragged-hold-history 1"


def test_rounds_keep_every_server_up_and_alternate_the_order(
        llama_8b_shape: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--rounds 3: all servers start before the first run and stop after the last; the order
    reverses every other round; a server that did not start beside the others starts alone and
    is measured too; one that fails while serving leaves the later rounds."""
    from sgl_ragged.testing.server import ServerError

    events: list[tuple] = []

    def refuse(label: str, attempt: int) -> None:
        if label == "baseline" and attempt == 1:
            raise ServerError("out of memory beside the others")

    Fake, _ = fake_deployments(events, refuse)

    def run_one(base_url, label, sessions, load, flush=True):
        events.append(("run", label))
        if label == "baseline" and sum(e == ("run", "baseline") for e in events) == 2:
            raise ServerError("died")
        return {"label": label, "request_rate": None}

    monkeypatch.setattr(multiturn, "_deployment", Fake)
    monkeypatch.setattr(multiturn, "run_one", run_one)
    args = multiturn.parse_args(["--model", str(llama_8b_shape), "--rounds", "3", "--out",
                                 str(tmp_path), "--launch", "ragged:uniform:0.3", "--launch",
                                 HOLD, "--launch", "baseline"])
    saved: list[int] = []
    done = multiturn.run_launched(args, str(llama_8b_shape), [], [multiturn.LoadConfig()],
                                  lambda so_far: saved.append(len(so_far.runs)))
    runs = [e[1] for e in events if e[0] == "run"]
    assert sorted(events[:2]) == [("up", "ragged:uniform:0.3"), ("up", HOLD)]
    assert events[2] == ("up", "baseline") and events[3][0] == "run"
    assert runs == ["ragged:uniform:0.3", HOLD, "baseline",  # round 1: launch order
                    "baseline", HOLD, "ragged:uniform:0.3",  # round 2: reversed; baseline dies
                    "ragged:uniform:0.3", HOLD]  # round 3 without it
    assert [(r["label"], r["round"]) for r in done.runs][-2:] == [("ragged:uniform:0.3", 2),
                                                                   (HOLD, 2)]
    assert [f["label"] for f in done.failed] == ["baseline"] and saved == [3, 5, 7]
    assert sorted(e for e in events if e[0] == "down") == sorted(
        ("down", label) for label in ("ragged:uniform:0.3", HOLD, "baseline"))
    assert events[-3:][0][0] == "down"  # all stopped after the last round
    # the report pairs what ran in a round with that round's baseline, none once it is gone
    for run in done.runs:
        run["summary"] = {"requests_per_s": 1.0}
    pairs = report.build(done.runs, done.failed, workload={}, argv=[])["ratios"]
    assert [(p["run"], p["round"]) for p in pairs] == [("ragged:uniform:0.3", 0), (HOLD, 0)]


def test_rounds_need_launched_servers() -> None:
    with pytest.raises(SystemExit):
        multiturn.parse_args(["--base-url", "http://x", "--rounds", "2"])
    with pytest.raises(SystemExit):
        multiturn.parse_args(["--launch", "baseline", "--rounds", "0"])


def _run(label: str, round_: int, rps: float, ttft: float) -> dict:
    summary = {"requests_per_s": rps, "output_tokens_per_s": rps * 10, "prefix_hit_rate": 0.5,
               "ttft_p50_ms": ttft, "tpot_p50_ms": 10.0, "max_total_num_tokens": 100,
               "peak_running": 1.0, "peak_token_usage": 0.5, "errors": 0, "accuracy": {},
               **{f"{m}_p{q}_ms": 1.0 for m in ("ttft", "tpot") for q in (90, 99)}}
    return {"label": label, "request_rate": None, "round": round_, "summary": summary}


def test_report_pairs_each_round_with_its_reference_and_gives_medians(tmp_path: Path) -> None:
    runs = [_run("ragged:uniform:0.3", 0, 1.0, 100.0), _run(HOLD, 0, 2.0, 50.0),
            _run(HOLD, 1, 1.5, 60.0), _run("ragged:uniform:0.3", 1, 1.0, 90.0),
            _run("ragged:uniform:0.3", 2, 0.5, 80.0), _run(HOLD, 2, 1.6, 70.0)]
    result = report.build(runs, workload={}, argv=[])
    assert [(p["round"], p["requests_per_s"]) for p in result["ratios"]] == [
        (0, 2.0), (1, 1.5), (2, pytest.approx(3.2))]
    medians = {m["label"]: m for m in result["medians"]}
    assert medians[HOLD]["requests_per_s"] == 1.6 and medians[HOLD]["rounds"] == 3
    assert medians[HOLD]["requests_per_s_ratio"] == 2.0  # of 2.0, 1.5, 3.2
    assert medians[HOLD]["ttft_p50_ms"] == 60.0
    assert math.isnan(medians["ragged:uniform:0.3"]["requests_per_s_ratio"])
    table = report.write(result, tmp_path, plots=False)
    assert f"| {HOLD} (round 2) | max | 1.500 |" in table
    assert f"| {HOLD} / ragged:uniform:0.3 (round 3) | max | 3.20 |" in table
    assert f"| {HOLD} | max | 3 | 1.600 | 2.00 | 60 | 0.500 |" in table
    saved = json.loads((tmp_path / "multiturn.json").read_text())
    assert saved["medians"][0]["requests_per_s_ratio"] is None  # the reference's: strict JSON


def test_report_without_rounds_has_no_median_table(tmp_path: Path) -> None:
    run = _run("baseline", 0, 1.0, 1.0)
    del run["round"]
    result = report.build([run], workload={}, argv=[])
    assert result["medians"] == [] and "median over rounds" not in report.markdown(result)
