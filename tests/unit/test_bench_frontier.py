"""bench.frontier: our best point per budget, and the figure from both benches' JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench import frontier


def _row(name: str, kind: str, nbytes: float, kl: float, top1: float) -> dict:
    stat = lambda m: {"mean": m, "se": 0.01, "n": 6}  # noqa: E731
    return {"name": name, "kind": kind, "rho": nbytes, "bytes": nbytes, "memory": nbytes,
            "kl": stat(kl), "token_acc": stat(top1), "agree": stat(top1)}


ROWS = [_row("full", "full", 1.0, 0.0, 0.8), _row("uniform@0.2", "uniform", 0.203, 1.5, 0.3),
        _row("int4@0.2", "tiers", 0.202, 0.9, 0.5), _row("int8+int2@0.2", "tiers-mixed", 0.201, 0.7, 0.6),
        _row("sglang-nvfp4", "stock", 0.281, 0.01, 0.79), _row("int4@0.5", "tiers", 0.499, 0.03, 0.79),
        _row("int8+int4@0.5", "tiers-mixed", 0.5, 0.006, 0.8)]


def test_best_per_budget_is_our_lowest_kl_near_each_budget():
    best = frontier.best_per_budget(frontier.offline_points({"configs": ROWS}))
    assert [p.name for p in best] == ["int8+int2@0.2", "int8+int4@0.5"]  # not SGLang's, not full


def test_the_figure_draws_both_benches(tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps({"configs": ROWS}))
    out = tmp_path / "f.png"
    frontier.main(["--server", str(tmp_path / "a.json"), "--offline", str(tmp_path / "a.json"),
                   "--out", str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_several_runs_merge_each_config_once(tmp_path: Path):
    """Runs over the same questions join one panel; a name in both comes from the first."""
    (tmp_path / "a.json").write_text(json.dumps({"configs": ROWS[:3]}))
    (tmp_path / "b.json").write_text(json.dumps({"configs": [_row("full", "full", 1.0, 0.0, 0.7),
                                                              _row("mixed@0.2", "profile", 0.203, 0.04, 0.78)]}))
    points = frontier.merged(frontier.server_points, [tmp_path / "a.json", tmp_path / "b.json"])
    assert sorted(p.name for p in points) == ["full", "int4@0.2", "mixed@0.2", "uniform@0.2"]
    assert next(p for p in points if p.name == "full").top1 == 0.8
    assert frontier.best_per_budget(points)[0].name == "mixed@0.2"
