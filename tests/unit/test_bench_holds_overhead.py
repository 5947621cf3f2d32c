"""bench.holds_overhead: its synthetic queues and its report, on tiny cases."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench import holds_overhead


def test_the_queues_hold_what_they_say() -> None:
    module = holds_overhead.load(None)
    holds, queue, _, _ = holds_overhead.build(module, 12, 3, 5, 400, 64, seed=1)
    assert len(holds.holds) == 3 and len(holds.finished) == 5 and len(queue) == 12
    holds.sweep(queue)
    assert holds.waiting_nodes(queue) <= set(holds.holds)
    continuing = [req for req in queue if holds._held_node(req) is not None]
    assert len(continuing) == 3  # a quarter of 12: next turns of held conversations


def test_a_run_against_a_revision_writes_both_medians(tmp_path) -> None:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=holds_overhead.REPO, check=True,
                             capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert holds_overhead.main(["--case", "8,2,4", "--length", "400", "--repeats", "2",
                                "--arrivals", "2", "--against", rev, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "holds_overhead.json").read_text())
    (row,) = result["rows"]
    assert (row["waiting"], row["held"], row["finished"]) == (8, 2, 4)
    for name in ("this", "against"):
        assert row[name]["iteration_s"] > 0 and row[name]["arrival_s"] > 0
    table = (tmp_path / "holds_overhead.md").read_text()
    assert f"| {rev} |" in table and "| x" in table


@pytest.mark.parametrize("case", ["1,2", "a,b,c", "4,3,2", "-1,0,0"])
def test_bad_cases_are_refused(case: str) -> None:
    with pytest.raises(SystemExit):
        holds_overhead.main(["--case", case])
