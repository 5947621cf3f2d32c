"""Unit tests of sgl_ragged.budgets: clustering, slots, split map (TANGRAM 4.2.2, Algorithm 1)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import combinations, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ragged.budgets import (
    adjacent_groups,
    check_heads_per_group,
    cluster_heads,
    group_budgets,
    group_memory_fraction,
    group_slots,
    slots_for_budget,
    split_map,
    split_map_from_ratios,
    split_ratios,
)

# Budgets in (0, 1], with frequent exact ties so the stable tie-break is exercised.
# Floor 1e-6 (under one token per million): subnormal budgets would underflow tau to 0.
budget_values = st.one_of(
    st.floats(min_value=1e-6, max_value=1.0),
    st.sampled_from([0.05, 0.25, 0.5, 1.0]),
)


@st.composite
def layer_and_group_size(draw: st.DrawFn, max_heads: int = 6) -> tuple[list[float], int]:
    """One layer's budgets [H] (H <= max_heads) and a group size H_p in {1, 2, 3} dividing H."""
    hpg = draw(st.sampled_from([1, 2, 3]))
    num_groups = draw(st.integers(min_value=1, max_value=max_heads // hpg))
    budgets = draw(st.lists(budget_values, min_size=hpg * num_groups, max_size=hpg * num_groups))
    return budgets, hpg


@st.composite
def profile_like(draw: st.DrawFn) -> tuple[list[list[float]], list[list[tuple[int, ...]]]]:
    """Budgets [L][H] and a random valid grouping [L][G][H_p] (not necessarily clustered)."""
    hpg = draw(st.sampled_from([1, 2, 4]))
    num_heads = hpg * draw(st.integers(min_value=1, max_value=4))
    num_layers = draw(st.integers(min_value=1, max_value=3))
    budgets, groups = [], []
    for _ in range(num_layers):
        layer = draw(st.lists(budget_values, min_size=num_heads, max_size=num_heads))
        order = draw(st.permutations(range(num_heads)))
        budgets.append(layer)
        groups.append([tuple(order[i : i + hpg]) for i in range(0, num_heads, hpg)])
    return budgets, groups


def equal_partitions(heads: Sequence[int], size: int) -> Iterator[list[tuple[int, ...]]]:
    """Every partition of ``heads`` into groups of ``size`` (brute force)."""
    if not heads:
        yield []
        return
    first, rest = heads[0], heads[1:]
    for others in combinations(rest, size - 1):
        remaining = [h for h in rest if h not in others]
        for tail in equal_partitions(remaining, size):
            yield [(first, *others), *tail]


def sum_of_group_maxima(budgets: Sequence[float], groups: Sequence[Sequence[int]]) -> float:
    return sum(max(budgets[h] for h in g) for g in groups)


def assert_partition(groups: Sequence[Sequence[int]], num_heads: int, size: int) -> None:
    assert sorted(h for g in groups for h in g) == list(range(num_heads))
    assert all(len(g) == size for g in groups)


# ----- grouping --------------------------------------------------------------------------


def test_adjacent_groups() -> None:
    assert adjacent_groups(8, 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert adjacent_groups(3, 1) == ((0,), (1,), (2,))
    assert adjacent_groups(4, 4) == ((0, 1, 2, 3),)


@pytest.mark.parametrize("hpg", [0, 3, 5, -2])
def test_bad_heads_per_group_names_the_divisors(hpg: int) -> None:
    with pytest.raises(ValueError, match=r"does not divide the 8 KV heads.*\[1, 2, 4, 8\]"):
        adjacent_groups(8, hpg)
    with pytest.raises(ValueError, match="does not divide"):
        cluster_heads([0.5] * 8, hpg)


def test_check_heads_per_group_rejects_non_int() -> None:
    with pytest.raises(ValueError, match="must be an int"):
        check_heads_per_group(4, 2.0)  # type: ignore[arg-type]


def test_cluster_heads_hand_example() -> None:
    # Sorted by budget: h1 (0.1), h3 (0.2), h2 (0.5), h0 (0.9).
    assert cluster_heads([0.9, 0.1, 0.5, 0.2], 2) == ((1, 3), (0, 2))
    assert cluster_heads([0.9, 0.1, 0.5, 0.2], 1) == ((1,), (3,), (2,), (0,))
    assert cluster_heads([0.9, 0.1, 0.5, 0.2], 4) == ((0, 1, 2, 3),)


def test_cluster_heads_ties_are_stable_by_head_index() -> None:
    assert cluster_heads([0.5] * 6, 2) == ((0, 1), (2, 3), (4, 5))
    # h0 and h3 tie at 0.2: h0 first; h1, h2 tie at 0.7.
    assert cluster_heads([0.2, 0.7, 0.7, 0.2, 0.1, 0.9], 3) == ((0, 3, 4), (1, 2, 5))


@settings(max_examples=300, deadline=None)
@given(layer_and_group_size())
def test_cluster_heads_is_sorted_runs(case: tuple[list[float], int]) -> None:
    budgets, hpg = case
    groups = cluster_heads(budgets, hpg)
    assert_partition(groups, len(budgets), hpg)
    assert all(list(g) == sorted(g) for g in groups)
    # Consecutive runs of the budget order: every head of group i is <= every head of group i+1.
    for lower, upper in pairwise(groups):
        assert max(budgets[h] for h in lower) <= min(budgets[h] for h in upper)


@settings(max_examples=300, deadline=None)
@given(layer_and_group_size())
def test_cluster_heads_minimises_sum_of_group_maxima(case: tuple[list[float], int]) -> None:
    budgets, hpg = case
    clustered = sum_of_group_maxima(budgets, cluster_heads(budgets, hpg))
    best = min(
        sum_of_group_maxima(budgets, p) for p in equal_partitions(list(range(len(budgets))), hpg)
    )
    assert math.isclose(clustered, best, rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=200, deadline=None)
@given(layer_and_group_size(), st.sampled_from([8, 16, 64]))
def test_cluster_heads_minimises_memory(case: tuple[list[float], int], page_size: int) -> None:
    budgets, hpg = case
    heads = list(range(len(budgets)))
    clustered = group_memory_fraction([budgets], [cluster_heads(budgets, hpg)], page_size)
    best = min(
        group_memory_fraction([budgets], [p], page_size) for p in equal_partitions(heads, hpg)
    )
    assert math.isclose(clustered, best, rel_tol=1e-12)


def test_equal_partitions_counts() -> None:
    # (H)! / ((H_p)!^(H/H_p) * (H/H_p)!) partitions: a check on the brute force itself.
    assert len(list(equal_partitions(list(range(6)), 2))) == 15
    assert len(list(equal_partitions(list(range(6)), 3))) == 10
    assert len(list(equal_partitions(list(range(4)), 1))) == 1


# ----- slots and memory ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "page_size", "min_slots", "expected"),
    [
        (0.07, 100, 1, 7),  # 0.07 * 100 == 7.000000000000001: no extra slot for float noise
        (0.55, 100, 4, 55),  # 55.00000000000001
        (0.5, 64, 4, 32),
        (0.501, 64, 4, 33),
        (0.01, 64, 4, 4),  # clamped up to the sink tokens
        (1.0, 64, 4, 64),
        (0.7, 3, 1, 3),  # ceil(2.1) = 3
    ],
)
def test_slots_for_budget(budget: float, page_size: int, min_slots: int, expected: int) -> None:
    assert slots_for_budget(budget, page_size, min_slots) == expected


def test_slots_for_budget_rejects_page_smaller_than_sinks() -> None:
    with pytest.raises(ValueError, match="page size of at least 4"):
        slots_for_budget(0.5, 2, 4)


def test_group_slots_uses_group_maximum() -> None:
    budgets = [[0.1, 0.9, 0.3, 0.2]]
    assert group_budgets(budgets, [[(0, 2), (1, 3)]]) == ((0.3, 0.9),)
    assert group_slots(budgets, [[(0, 2), (1, 3)]], 10, 1) == ((3, 9),)


def test_group_memory_fraction_hand_examples() -> None:
    budgets = [[0.25, 1.0, 0.25, 1.0]]
    # Clustered: k = (4, 16) for groups of 2 heads -> (4*2 + 16*2) / (16*4).
    assert group_memory_fraction(budgets, [[(0, 2), (1, 3)]], 16) == pytest.approx(0.625)
    # Adjacent: both groups contain a 1.0 head -> full size.
    assert group_memory_fraction(budgets, [[(0, 1), (2, 3)]], 16) == pytest.approx(1.0)
    # Two layers average; uniform 1.0 is the full cache.
    two = [[1.0] * 4, [0.25] * 4]
    assert group_memory_fraction(two, [[(0, 1, 2, 3)]] * 2, 16) == pytest.approx(0.625)


@settings(max_examples=200, deadline=None)
@given(profile_like(), st.sampled_from([4, 16, 64]), st.integers(min_value=1, max_value=4))
def test_group_memory_fraction_is_bytes_ratio(case, page_size: int, min_slots: int) -> None:
    budgets, groups = case
    head_dim, dtype_bytes = 128, 2
    ragged = full = 0
    for layer, layer_groups in zip(budgets, groups, strict=True):
        full += 2 * page_size * len(layer) * head_dim * dtype_bytes
        for g in layer_groups:
            need = max(layer[h] for h in g) * page_size - 1e-9
            k = min(max(math.ceil(need), min_slots), page_size)
            ragged += 2 * k * len(g) * head_dim * dtype_bytes
    got = group_memory_fraction(budgets, groups, page_size, min_slots)
    assert got == pytest.approx(ragged / full, rel=1e-12)


# ----- split map (Algorithm 1) -----------------------------------------------------------


def round_half_up(x: float) -> int:
    return int(math.floor(x) + (1 if x - math.floor(x) >= 0.5 else 0))


def algorithm1(budgets, groups, num_ctas: int) -> list[list[int]]:
    """Line-by-line transcription of TANGRAM Algorithm 1."""
    s = [[1] * len(layer_groups) for layer_groups in groups]  # line 1
    for l in range(len(budgets)):  # noqa: E741 - the paper's index name
        omega = 0.0
        for h in range(len(budgets[l])):  # line 3
            omega += budgets[l][h]
        if omega == 0:  # line 4
            continue
        tau = omega / num_ctas  # line 6
        for i in range(len(groups[l])):  # line 7
            phi = 0.0
            for h in groups[l][i]:  # line 9
                phi += budgets[l][h]
            s[l][i] = max(1, round_half_up(phi / tau))  # line 10
    return s


@settings(max_examples=300, deadline=None)
@given(profile_like(), st.integers(min_value=1, max_value=512))
def test_split_map_matches_algorithm1(case, num_ctas: int) -> None:
    budgets, groups = case
    expected = algorithm1(budgets, groups, num_ctas)
    assert [list(row) for row in split_map(budgets, groups, num_ctas)] == expected


@pytest.mark.parametrize(
    ("budgets", "groups", "num_ctas", "expected"),
    [
        # Omega = 1, tau = 0.1, Phi = (0.3, 0.7) -> S = (3, 7).
        ([[0.1, 0.2, 0.3, 0.4]], [[(0, 1), (2, 3)]], 10, ((3, 7),)),
        # Omega = 0: the layer keeps S = 1 everywhere.
        ([[0.0, 0.0, 0.0, 0.0]], [[(0, 1), (2, 3)]], 8, ((1, 1),)),
        # A tiny head still gets one CTA; tau = 0.0301, 1.0 / tau = 33.2.
        ([[0.01, 1.0, 1.0, 1.0]], [[(0,), (1,), (2,), (3,)]], 100, ((1, 33, 33, 33),)),
        # Tie: Phi / tau = 1.0 / 0.4 = 2.5 rounds up (C round), not to even.
        ([[0.5] * 4], [[(0, 1), (2, 3)]], 5, ((3, 3),)),
        # Fewer CTAs than groups: everything is max(1, round(<1)).
        ([[0.5] * 4], [[(0,), (1,), (2,), (3,)]], 1, ((1, 1, 1, 1),)),
        # Two layers are independent; groups need not be in head order.
        (
            [[0.2, 0.2, 0.6, 1.0], [1.0, 1.0, 1.0, 1.0]],
            [[(3, 0), (1, 2)], [(0, 1), (2, 3)]],
            20,
            ((12, 8), (10, 10)),
        ),
    ],
)
def test_split_map_hand_examples(budgets, groups, num_ctas, expected) -> None:
    assert split_map(budgets, groups, num_ctas) == expected


def test_split_map_rejects_no_ctas() -> None:
    with pytest.raises(ValueError, match="num_ctas"):
        split_map([[0.5]], [[(0,)]], 0)


def test_split_ratios_hand_example() -> None:
    ratios = split_ratios([[0.1, 0.2, 0.3, 0.4], [0.0] * 4], [[(0, 1), (2, 3)]] * 2)
    assert ratios[0] == pytest.approx((0.3, 0.7))
    assert ratios[1] == (0.0, 0.0)


@settings(max_examples=300, deadline=None)
@given(profile_like(), st.integers(min_value=1, max_value=512))
def test_split_map_from_ratios_equals_algorithm1(case, num_ctas: int) -> None:
    budgets, groups = case
    ratios = split_ratios(budgets, groups)
    for row in ratios:
        assert math.fsum(row) == pytest.approx(1.0)
    direct = split_map(budgets, groups, num_ctas)
    derived = split_map_from_ratios(ratios, num_ctas)
    for l, (d_row, r_row) in enumerate(zip(direct, derived, strict=True)):  # noqa: E741
        for g, (d, r) in enumerate(zip(d_row, r_row, strict=True)):
            # The two float paths may differ only by rounding at an exact .5 tie.
            x = ratios[l][g] * num_ctas
            near_tie = abs(x - math.floor(x) - 0.5) < 1e-9
            assert d == r or near_tie
