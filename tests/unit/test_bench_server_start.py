"""bench/server_start.py's summary: medians per start method and the fork/spawn ratios."""

from __future__ import annotations

import pytest

from bench import server_start


def test_summary_has_medians_and_ratios() -> None:
    samples = {"fork": [{"ready_s": 40.0, "cpu_s": 43.0, "pss_gb": 2.3},
                        {"ready_s": 38.0, "cpu_s": 41.0, "pss_gb": 2.3},
                        {"ready_s": 50.0, "cpu_s": 45.0, "pss_gb": 2.4}],
               "spawn": [{"ready_s": 67.0, "cpu_s": 94.0, "pss_gb": 3.2},
                         {"ready_s": 66.0, "cpu_s": 92.0, "pss_gb": 3.1},
                         {"ready_s": 80.0, "cpu_s": 90.0, "pss_gb": 3.2}]}
    summary = server_start.summarize(samples)
    assert summary["fork"] == {"ready_s": 40.0, "cpu_s": 43.0, "pss_gb": 2.3}
    assert summary["spawn"] == {"ready_s": 67.0, "cpu_s": 92.0, "pss_gb": 3.2}
    assert summary["fork/spawn"]["cpu_s"] == pytest.approx(43.0 / 92.0)
    table = server_start.markdown(summary, 3, "ragged")
    assert "| fork | 40.0 | 43.0 | 2.30 | - |" in table
    assert "| fork/spawn | x0.60 | x0.47 | x0.72 | - |" in table
    for method, seconds in (("fork", 9.0), ("spawn", 8.7)):
        for sample in samples[method]:
            sample["decode_s"] = seconds
    table = server_start.markdown(server_start.summarize(samples), 3, "ragged")
    assert "| fork/spawn | x0.60 | x0.47 | x0.72 | x1.034 |" in table
    # The rounds' own ratios: 0.9, 1.091, 1.111 (the medians' ratio is 1.0).
    for method, seconds in (("fork", (9.0, 12.0, 10.0)), ("spawn", (10.0, 11.0, 9.0))):
        for sample, s in zip(samples[method], seconds, strict=True):
            sample["decode_s"] = s
    summary = server_start.summarize(samples)
    assert summary["fork/spawn"]["decode_s"] == pytest.approx(1.0)
    assert summary["fork/spawn"]["decode_paired"] == pytest.approx(12.0 / 11.0)
    assert "each round's fork/spawn ratio: x1.091." in server_start.markdown(summary, 3, "ragged")


def test_the_ragged_server_is_the_readmes() -> None:
    args = server_start.server_args("/m", "ragged")
    assert args[args.index("--attention-backend") + 1] == "ragged"
    assert "--ragged-profile" in args and "--ragged-precision" in args
    stock = server_start.server_args("/m", "torch_native")
    assert stock[stock.index("--attention-backend") + 1] == "torch_native"
    assert "--ragged-profile" not in stock


def test_paired_summary_ratios_per_pair() -> None:
    times = {"fork": [10.0, 9.0, 12.0, 8.0], "spawn": [9.0, 10.0, 10.0, 8.0]}
    summary = server_start.paired_summary(times)
    ratios = [10 / 9, 0.9, 1.2, 1.0]
    assert summary["pairs"] == 4 and summary["slower_forked"] == 2
    assert summary["fork_s"] == pytest.approx(9.5) and summary["spawn_s"] == pytest.approx(9.5)
    assert summary["ratio_median"] == pytest.approx((10 / 9 + 1.0) / 2)
    assert summary["ratio_mean"] == pytest.approx(sum(ratios) / 4)
    line = server_start.paired_markdown(summary, 96)
    assert "4 alternating pairs of 96 tokens" in line and "2 pairs slower forked" in line


def test_paired_summary_with_the_schedulers_counters() -> None:
    times = {"fork": [10.0, 9.0], "spawn": [9.0, 10.0]}
    counters = {"fork": [{"cpu_s": 11.0, "wait_s": 0.5}, {"cpu_s": 10.0, "wait_s": 0.7}],
                "spawn": [{"cpu_s": 10.0, "wait_s": 0.4}, {"cpu_s": 12.5, "wait_s": 0.6}]}
    summary = server_start.paired_summary(times, counters)
    assert summary["fork_sched_cpu_s"] == pytest.approx(10.5)
    assert summary["spawn_sched_wait_s"] == pytest.approx(0.5)
    assert summary["sched_cpu_ratio_mean"] == pytest.approx((1.1 + 0.8) / 2)
    text = server_start.paired_markdown(summary, 96)
    assert "forked 10.50 CPU-s, 0.60 s waiting for a CPU" in text
    assert "CPU-seconds fork/spawn per pair mean x0.950" in text


def test_scheduler_seconds_reads_a_scheduler_tree() -> None:
    """Only processes named as SGLang's schedulers count (this test's own process does not),
    and their counters only grow."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    code = ("import setproctitle, time\nsetproctitle.setproctitle('sglang::scheduler')\n"
            "sum(i * i for i in range(3_000_000))\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        me = psutil.Process(os.getpid())
        for _ in range(100):
            cpu, wait = server_start.scheduler_seconds(me)
            if cpu > 0.05:
                break
            time.sleep(0.1)
        assert cpu > 0.05 and wait >= 0.0
        assert server_start.scheduler_seconds(psutil.Process(child.pid))[0] >= cpu
    finally:
        child.kill()
        child.wait()
