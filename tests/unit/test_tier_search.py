"""The row-composition search (calibrate/tier_search.py): candidate compositions against a
brute force, and a whole search on a tiny random-weight model through the CLI, whose profile
then drives the server's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_ragged.calibrate.tier_search import candidate_tiers, shared_composition
from sgl_ragged.cli import main
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.tiers import RowTiers, compose, tier_bytes
from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.profile import BudgetProfile, model_shape, uniform_profile


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
@pytest.mark.parametrize("share", [0.0, 0.15, 0.5, 1.0])
def test_shared_composition_matches_brute_force(name, share):
    fmt = LOW_PRECISIONS[name]
    for slots in range(4, 65, 5):
        got = shared_composition(slots, 64, 64, 2, fmt, share)
        hi = int(share * slots + 1e-9)
        full = 2 * 64 * 2
        fits = [n for n in range(64 - hi + 1) if fmt.tier_bytes(n, 1, 64) <= (slots - hi) * full]
        want = RowTiers(hi, max(fits)) if hi + max(fits) >= 4 else RowTiers(slots)
        assert got == want
        assert tier_bytes(got, fmt, 1, 64, 2) <= slots * full  # never above the budget


def test_candidates_hold_the_rule_and_each_share():
    profile = uniform_profile(0.3, 2, 3, 1)
    cands = candidate_tiers(profile, 64, 64, 2, LOW_PRECISIONS["int4"], (0.0, 1.0))
    assert list(cands) == ["rule", "share=0", "share=1"]
    assert cands["rule"][0][0] == compose(20, 64, 64, 2, LOW_PRECISIONS["int4"], 4) == RowTiers(2, 62)
    assert cands["share=1"][0][0] == RowTiers(20)  # drop only
    assert cands["share=0"][0][0] == RowTiers(0, 64)


def test_tier_search_cli_writes_a_profile_the_layout_uses(tiny_llama: Path, tmp_path: Path, capsys):
    model = tiny_llama
    out = tmp_path / "tiered.json"
    assert main(["profile", "tiers", "uniform:0.5", "--model", str(model), "--precision", "int4",
                 "-o", str(out), "--samples", "2", "--shares", "0", "1", "--page-size", "16",
                 "--chunk-size", "32", "--min-tokens", "128", "--max-tokens", "128"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["version"] == 2 and data["tiers"]["precision"] == "int4"
    search = data["stats"]["tier_search"]
    rows = {r["name"]: r for r in search["candidates"]}
    assert set(rows) == {"rule", "share=0", "share=1"} and "<- chosen" in printed
    assert search["chosen"] == min(rows, key=lambda n: rows[n]["kl"])
    assert all(r["kl"] > 0 and r["bytes"] <= 0.5 + 1e-9 for r in rows.values())
    profile = BudgetProfile.load(out)
    shape = model_shape(str(model))
    assert profile.model == shape  # uniform:0.5 names no model; the searched profile does
    layout = RaggedLayout.from_profile(profile, 16, shape.head_dim, 2, "int4")
    want = candidate_tiers(profile, 16, shape.head_dim, 2, LOW_PRECISIONS["int4"], (0.0, 1.0))
    assert layout.tiers == want[search["chosen"]]
    assert layout.retention == pytest.approx(rows[search["chosen"]]["bytes"])
    assert main(["profile", "show", str(out)]) == 0
    assert f"searched: {search['chosen']}" in capsys.readouterr().out


def test_tier_search_refuses_drop_only(tmp_path: Path, capsys):
    assert main(["profile", "tiers", "uniform:0.5", "--precision", "bf16", "-o",
                 str(tmp_path / "x.json"), "--model", str(tmp_path)]) == 2
    assert "must be a low precision" in capsys.readouterr().err
