"""Tensor-parallel slicing of profiles (sgl_ragged/tp.py): heads per rank, groups within a rank,
per-rank split ratios, refusals, and one logical capacity agreed by every rank."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ragged.budgets import adjacent_groups, cluster_heads, group_slots, split_ratios
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import BudgetProfile, ModelShape, ProfileError
from sgl_ragged.profile.tiers import ProfileTiers
from sgl_ragged.tp import (
    TP_SOURCE_KEY,
    agreed_cell_size,
    agreed_logical_pages,
    check_tp_size,
    rank_heads,
    resolve_rank_profiles,
    slice_profile,
)

SHAPE = ModelShape("LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_dim=16)
# Layer 0 clusters {0, 2} / {1, 3}: both groups straddle ranks {0, 1} / {2, 3} at tp 2.
BUDGETS = ((0.2, 0.9, 0.3, 0.8), (0.5, 0.6, 0.1, 0.2))


def calibrated(budgets=BUDGETS, groups=None, heads_per_group: int = 2) -> BudgetProfile:
    groups = groups or tuple(cluster_heads(layer, heads_per_group) for layer in budgets)
    shape = ModelShape("LlamaForCausalLM", len(budgets), len(budgets[0]), 16)
    return BudgetProfile(shape, budgets, groups, {"kind": "calibrated", "rho": 0.3},
                         mu=budgets, sigma=tuple(tuple(0.0 for _ in r) for r in budgets),
                         split_ratios=split_ratios(budgets, groups),
                         stats={"coverage": 0.9})


def layout_of(profile: BudgetProfile) -> RaggedLayout:
    return RaggedLayout.from_profile(profile, page_size=64, head_dim=16, dtype_bytes=2)


def test_rank_heads_are_contiguous_and_partition_the_heads() -> None:
    assert [rank_heads(8, 4, r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert sorted(h for r in range(2) for h in rank_heads(4, 2, r)) == [0, 1, 2, 3]
    with pytest.raises(ProfileError, match="rank 2 is outside"):
        rank_heads(4, 2, 2)


@pytest.mark.parametrize("tp", [3, 5, 8])
def test_tp_not_dividing_the_kv_heads_is_refused(tp: int) -> None:
    with pytest.raises(ProfileError, match=rf"--tp-size {tp} does not divide the model's 4 KV heads.*\[1, 2, 4\]"):
        check_tp_size(4, tp)
    with pytest.raises(ProfileError, match=f"--tp-size {tp} does not divide"):
        resolve_rank_profiles("uniform:0.5", SHAPE, None, tp)


def test_straddling_groups_are_reclustered_within_each_rank() -> None:
    profile = calibrated()
    assert profile.groups[0] == ((0, 2), (1, 3))  # straddles ranks {0,1} / {2,3}
    for rank in range(2):
        part = slice_profile(profile, 2, rank)
        heads = rank_heads(4, 2, rank)
        assert part.budgets == tuple(tuple(layer[h] for h in heads) for layer in BUDGETS)
        assert part.mu == part.budgets
        # One group of the rank's 2 heads per layer (local indices), clustered by budget.
        assert part.groups == tuple(cluster_heads(layer, 2) for layer in part.budgets)
        assert part.groups == (((0, 1),), ((0, 1),))
        assert part.model == ModelShape("LlamaForCausalLM", 2, 2, 16)
        assert part.source[TP_SOURCE_KEY] == {"size": 2, "rank": rank, "heads": list(heads)}
        assert part.source["kind"] == "calibrated" and part.stats == {"coverage": 0.9}


def test_groups_within_a_rank_are_kept() -> None:
    # Adjacent groups of 2 at tp 2 lie within ranks: slicing keeps them, and the ranks' rows
    # add up to exactly the whole model's rows.
    groups = tuple(adjacent_groups(4, 2) for _ in BUDGETS)
    profile = calibrated(groups=groups)
    parts = [slice_profile(profile, 2, r) for r in range(2)]
    assert all(p.groups == (((0, 1),), ((0, 1),)) for p in parts)
    assert sum(layout_of(p).row_bytes_per_page for p in parts) == layout_of(profile).row_bytes_per_page


def test_clustering_within_a_rank_is_optimal() -> None:
    # 8 heads, tp 2, groups of 2: per rank and layer, the clustered groups minimise the sum of
    # the group maxima (the rank's row slots) over every partition of its heads into pairs.
    budgets = ((0.9, 0.1, 0.8, 0.2, 0.5, 0.45, 0.05, 0.6),)
    profile = calibrated(budgets, heads_per_group=2)
    for rank in range(2):
        part = slice_profile(profile, 2, rank)
        local = part.budgets[0]
        got = sum(group_slots(part.budgets, part.groups, 64)[0])
        best = min(
            sum(group_slots((local,), ((tuple(p[:2]), tuple(p[2:])),), 64)[0])
            for p in itertools.permutations(range(4))
        )
        assert got == best


def test_split_ratios_are_per_rank() -> None:
    for rank in range(2):
        part = slice_profile(calibrated(), 2, rank)
        assert part.split_ratios == split_ratios(part.budgets, part.groups)
        assert all(abs(sum(layer) - 1.0) < 1e-9 for layer in part.split_ratios)
    assert slice_profile(calibrated(), 2, 0).split_ratios != calibrated().split_ratios


def test_a_group_larger_than_a_rank_is_refused_with_the_fix() -> None:
    whole_groups = calibrated(heads_per_group=4)  # one group of all 4 heads per layer
    with pytest.raises(ProfileError, match=r"head groups of 4 cannot be formed.*holds 2 of the 4.*\[1, 2\]"):
        slice_profile(whole_groups, 2, 0)
    # The explicit group size applies per rank.
    assert slice_profile(whole_groups, 2, 0, heads_per_group=1).groups[0] == ((0,), (1,))
    with pytest.raises(ProfileError, match="--ragged-heads-per-group 4 cannot be formed"):
        resolve_rank_profiles("uniform:0.5", SHAPE, 4, 2)


def test_uniform_profiles_get_one_group_per_rank() -> None:
    parts = resolve_rank_profiles("uniform:0.5", SHAPE, None, 2)
    assert len(parts) == 2
    assert all(p.groups == (((0, 1),), ((0, 1),)) and p.num_kv_heads == 2 for p in parts)
    assert all(p.source["kind"] == "uniform" and p.model is None for p in parts)


def test_the_dynamic_reference_mode_is_refused_under_tp() -> None:
    with pytest.raises(ProfileError, match="dynamic reference mode.*--tp-size 1"):
        resolve_rank_profiles("dynamic:0.3", SHAPE, None, 2)
    assert len(resolve_rank_profiles("dynamic:0.3", SHAPE, None, 1)) == 1


def test_tp_1_is_the_whole_profile(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    calibrated().save(path)
    (whole,) = resolve_rank_profiles(str(path), SHAPE, None, 1)
    assert whole == BudgetProfile.load(path)


def test_sliced_profiles_are_valid_profiles(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    calibrated().save(path)
    for part in resolve_rank_profiles(str(path), SHAPE, None, 2):
        assert BudgetProfile.from_dict(part.to_dict()) == part


def test_ranks_agree_on_one_capacity_the_smallest() -> None:
    # Rank 0 holds heads with budgets (0.9, 0.9), rank 1 (0.1, 0.1): different bytes per page.
    budgets = ((0.9, 0.9, 0.1, 0.1),) * 2
    profile = calibrated(budgets)
    layouts = [layout_of(slice_profile(profile, 2, r)) for r in range(2)]
    assert layouts[0].row_bytes_per_page > layouts[1].row_bytes_per_page
    available, staging = 50_000_000, 6
    own = [layout.num_logical_pages(available, staging) for layout in layouts]
    assert own[0] < own[1]
    assert agreed_logical_pages(layouts, available, staging) == own[0]
    assert agreed_cell_size(layouts) == -(-layouts[0].row_bytes_per_page // 64)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_slices_cover_every_head_once(data: st.DataObject) -> None:
    tp = data.draw(st.sampled_from([1, 2, 4]))
    heads = tp * data.draw(st.sampled_from([1, 2, 4]))
    hpg = data.draw(st.sampled_from([d for d in (1, 2, 4) if (heads // tp) % d == 0]))
    budgets = tuple(tuple(data.draw(st.floats(0.05, 1.0)) for _ in range(heads)) for _ in range(2))
    profile = calibrated(budgets, heads_per_group=min(hpg * tp, heads))
    parts = [slice_profile(profile, tp, r, heads_per_group=hpg) for r in range(tp)]
    for layer in range(2):
        seen = []
        for rank, part in enumerate(parts):
            glob = rank_heads(heads, tp, rank)
            for group in part.groups[layer]:
                assert len(group) == hpg
                seen.extend(glob[h] for h in group)
                assert all(part.budgets[layer][h] == budgets[layer][glob[h]] for h in group)
        assert sorted(seen) == list(range(heads))


def test_tiers_of_groups_that_straddle_ranks_are_refused_with_the_reason() -> None:
    profile = calibrated()  # layer 0's groups {0, 2} / {1, 3} straddle the tp-2 ranks
    hi = tuple(tuple(0.0 for _ in layer) for layer in BUDGETS)
    lo = tuple(tuple(0.5 for _ in layer) for layer in BUDGETS)
    tiered = dataclasses.replace(profile, tiers=ProfileTiers("int4", hi, lo))
    with pytest.raises(ProfileError, match=r"row tiers \(tiers 'int4'\).*at layer 0 its groups "
                                           r"\[\[0, 2\], \[1, 3\]\] cannot be kept on the --tp-size 2 "
                                           r"rank holding heads \[0, 1\]"):
        slice_profile(tiered, 2, 0)
    # groups within the ranks keep their tiers
    adjacent = tuple(adjacent_groups(4, 2) for _ in BUDGETS)
    kept = dataclasses.replace(calibrated(groups=adjacent), tiers=ProfileTiers("int4", hi, lo))
    assert slice_profile(kept, 2, 1).tiers.lo == ((0.5, 0.5), (0.5, 0.5))
