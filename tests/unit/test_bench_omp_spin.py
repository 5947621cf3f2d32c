"""bench.omp_spin: its table (rates as rates, TPOT as a time whose ratio is inverted), its launch
and its refusals; the rounds themselves need servers (the bench's own run)."""

from __future__ import annotations

import argparse

import pytest

from bench import omp_spin


def _report(**overrides):
    report = {"served": "ragged mixed:p.json", "max_tokens": 96, "repeats": 3,
              "concurrency": [1, 8], "long_prompt": 1900, "long_concurrency": 8,
              "contention": True,
              "spins": {"0": {"short_1_tok_s": 50.0, "short_8_tok_s": 200.0,
                              "long_tpot_s": 0.060, "contention_tok_s": 300.0},
                        "3000": {"short_1_tok_s": 55.0, "short_8_tok_s": 240.0,
                                 "long_tpot_s": 0.050, "contention_tok_s": 240.0}}}
    report.update(overrides)
    return report


def test_table_rows_and_ratios():
    table = omp_spin.markdown(_report())
    assert "| spin 0 | spin 3000 | 3000 / 0 |" in table
    assert "| short, 1 requests (tok/s) | 50.0 | 55.0 | x1.10 |" in table
    assert "| short, 8 requests (tok/s) | 200.0 | 240.0 | x1.20 |" in table
    # a shorter TPOT is faster: 60 ms -> 50 ms reads x1.20
    assert "| 8 x 1900-token documents (TPOT ms) | 60.0 | 50.0 | x1.20 |" in table
    assert "| two servers at once, 8 requests each (tok/s, summed) | 300.0 | 240.0 | x0.80 |" in table


def test_table_leaves_out_rounds_not_run():
    report = _report(long_prompt=0, contention=False)
    for spin in report["spins"].values():
        del spin["long_tpot_s"], spin["contention_tok_s"]
    table = omp_spin.markdown(report)
    assert "TPOT" not in table and "two servers" not in table
    assert table.count("| short,") == 2


def test_launch_serves_the_largest_batch():
    args = argparse.Namespace(
        profile="p.json", precision="mixed", max_total_tokens=40000, concurrency=[1, 8],
        long_concurrency=12)
    launch = omp_spin.launch_args("/m", args)
    assert launch[launch.index("--max-running-requests") + 1] == "12"
    assert launch[launch.index("--ragged-precision") + 1] == "mixed"


def test_a_setting_may_set_the_dots_split_threshold():
    assert omp_spin.setting_env("3000") == {"GOMP_SPINCOUNT": "3000"}
    assert omp_spin.setting_env("3000:4194304") == {"GOMP_SPINCOUNT": "3000",
                                                     "RAGGED_DOT_SERIAL_MACS": "4194304"}


def test_a_setting_may_pick_the_kernels_pool():
    assert omp_spin.setting_env("3000/openmp") == {"GOMP_SPINCOUNT": "3000",
                                                    "RAGGED_NATIVE_POOL": "openmp"}
    assert omp_spin.setting_env("0:262144/pool@20") == {
        "GOMP_SPINCOUNT": "0", "RAGGED_DOT_SERIAL_MACS": "262144", "RAGGED_NATIVE_POOL": "pool",
        "RAGGED_POOL_SPIN_US": "20"}


@pytest.mark.parametrize("argv", [["--spins", "0", "0"], ["--spins", "-1"], ["--repeats", "0"],
                                  ["--long-concurrency", "0"], ["--spins", "3000:"],
                                  ["--spins", "1:2:3"], ["--spins", "3000:x"],
                                  ["--spins", "3000/omp"], ["--spins", "3000/openmp@5"],
                                  ["--spins", "3000/pool@x"], ["--spins", "3000/"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        omp_spin.main(argv)
    assert "error:" in capsys.readouterr().err


def test_the_settings_take_turns_going_first(monkeypatch):
    """Which server a round measures first swaps every round (with a fixed order, session 33's
    first A/B of two settings gave x1.08-1.14, the same A/B the other way round x0.96-1.03)."""
    seen = []

    async def one_round(url, concurrency, max_tokens, seed):
        seen.append(url)
        return {"tok_s": 1.0}

    monkeypatch.setattr(omp_spin, "one_round", one_round)
    args = argparse.Namespace(warmup=1, repeats=2, concurrency=[1], max_tokens=8, long_prompt=0,
                              contention=False)
    result = omp_spin.measure({"a": ["url-a"], "b": ["url-b"]}, args)
    assert seen == ["url-a", "url-b", "url-b", "url-a", "url-a", "url-b"]
    assert result == {"a": {"short_1_tok_s": 1.0}, "b": {"short_1_tok_s": 1.0}}
