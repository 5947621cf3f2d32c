"""Pure functions on per-(layer, KV head) retention budgets.

Index spaces: ``budgets[l][h]`` is the retention budget B of KV head h of layer l
(a fraction of the tokens in (0, 1]); ``groups[l][g]`` lists the KV-head indices of
head group g of layer l (H_p heads each); ``k[l][g]`` is the number of row slots a
group keeps per logical page of P tokens (docs/architecture.md, "The idea in one table").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Budgets = Sequence[Sequence[float]]  # [L][H] retention budgets
Groups = Sequence[Sequence[Sequence[int]]]  # [L][G][H_p] KV-head indices

# Subtracted from B * P before the ceiling so that floating-point noise
# (0.07 * 100 == 7.000000000000001) does not cost a whole extra slot.
SLOT_EPSILON = 1e-9


def check_heads_per_group(num_heads: int, heads_per_group: int) -> None:
    """Raise ValueError unless ``heads_per_group`` is a positive divisor of ``num_heads``."""
    if isinstance(heads_per_group, bool) or not isinstance(heads_per_group, int):
        raise ValueError(f"heads_per_group must be an int, got {heads_per_group!r}")
    if heads_per_group < 1 or num_heads % heads_per_group != 0:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"heads_per_group={heads_per_group} does not divide the {num_heads} KV heads "
            f"into equal groups; choose one of {divisors}"
        )


def adjacent_groups(num_heads: int, heads_per_group: int) -> tuple[tuple[int, ...], ...]:
    """Group heads by index: (0..H_p-1), (H_p..2H_p-1), ... (the paper's "adjacent" baseline)."""
    check_heads_per_group(num_heads, heads_per_group)
    return tuple(
        tuple(range(start, start + heads_per_group))
        for start in range(0, num_heads, heads_per_group)
    )


def cluster_heads(
    layer_budgets: Sequence[float], heads_per_group: int
) -> tuple[tuple[int, ...], ...]:
    """Budget-aware clustering of one layer's heads (TANGRAM section 4.2.2).

    Sort heads by budget ascending (ties broken by head index), then take runs of
    ``heads_per_group`` consecutive heads of that order as groups. Groups come out in
    ascending budget order; heads inside a group are listed by ascending index.
    This grouping minimises the sum over groups of the group maximum, i.e. the
    ragged storage of the layer.
    """
    num_heads = len(layer_budgets)
    check_heads_per_group(num_heads, heads_per_group)
    order = sorted(range(num_heads), key=lambda h: (layer_budgets[h], h))
    return tuple(
        tuple(sorted(order[start : start + heads_per_group]))
        for start in range(0, num_heads, heads_per_group)
    )


def group_budgets(budgets: Budgets, groups: Groups) -> tuple[tuple[float, ...], ...]:
    """[L][G] budget of each group: the largest budget among its heads (section 4.2.1)."""
    return tuple(
        tuple(max(layer[h] for h in group) for group in layer_groups)
        for layer, layer_groups in zip(budgets, groups, strict=True)
    )


def slots_for_budget(budget: float, page_size: int, min_slots: int = 4) -> int:
    """Row slots per logical page for budget B: clamp(ceil(B * P), min_slots, P).

    ``min_slots`` is the number of sink tokens: every group keeps at least that many
    slots so the first page of a sequence can always hold its sink tokens.
    """
    if not 1 <= min_slots <= page_size:
        raise ValueError(
            f"min_slots={min_slots} must be in [1, page_size={page_size}]: the first page "
            f"must keep the sink tokens; use a page size of at least {min_slots}"
        )
    wanted = math.ceil(budget * page_size - SLOT_EPSILON)
    return min(max(wanted, min_slots), page_size)


def group_slots(
    budgets: Budgets, groups: Groups, page_size: int, min_slots: int = 4
) -> tuple[tuple[int, ...], ...]:
    """[L][G] row slots k[l][g] per logical page (docs/architecture.md, "The idea in one table")."""
    return tuple(
        tuple(slots_for_budget(b, page_size, min_slots) for b in layer)
        for layer in group_budgets(budgets, groups)
    )


def group_memory_fraction(
    budgets: Budgets, groups: Groups, page_size: int, min_slots: int = 4
) -> float:
    """Bytes of ragged storage per logical page relative to a full KV page.

    Per layer the ragged bytes are sum_g k[l,g] * H_p and the full bytes P * H, so the
    fraction is the mean over layers of sum_g k[l,g] * H_p / (P * H)
    (= the mean over all (l, g) of k[l,g] / P, since G * H_p = H).
    """
    slots = group_slots(budgets, groups, page_size, min_slots)
    per_layer = [
        sum(k * len(group) for k, group in zip(layer_slots, layer_groups, strict=True))
        / (page_size * len(layer_budgets))
        for layer_slots, layer_groups, layer_budgets in zip(slots, groups, budgets, strict=True)
    ]
    return sum(per_layer) / len(per_layer)


def _round_half_up(x: float) -> int:
    """round() as C/CUDA define it for x >= 0 (ties away from zero, not to even).

    Not floor(x + 0.5): that rounds 0.49999999999999994 up. x - floor(x) is exact.
    """
    whole = math.floor(x)
    return whole + 1 if x - whole >= 0.5 else whole


def split_map(budgets: Budgets, groups: Groups, num_ctas: int) -> tuple[tuple[int, ...], ...]:
    """Static workload split map S[l][g] (TANGRAM Algorithm 1, section 4.3.1).

    Omega = total budget of the layer, tau = Omega / N_CTA the target budget per
    split, Phi = total budget of the group, S = max(1, round(Phi / tau)); a layer with
    Omega == 0 keeps S = 1 for every group. round() rounds ties away from zero.
    """
    if num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
    result = []
    for layer, layer_groups in zip(budgets, groups, strict=True):
        # Omega: total budget of the layer; no work means one split per group.
        omega = sum(layer)
        if omega == 0:
            result.append(tuple(1 for _ in layer_groups))
            continue
        # tau: target budget per split; Phi: aggregated budget of each group.
        tau = omega / num_ctas
        phis = [sum(layer[h] for h in group) for group in layer_groups]
        result.append(tuple(max(1, _round_half_up(phi / tau)) for phi in phis))
    return tuple(result)


def split_ratios(budgets: Budgets, groups: Groups) -> tuple[tuple[float, ...], ...]:
    """[L][G] device-independent form of the split map: Phi[l,g] / Omega[l].

    A device with N_CTA concurrent CTAs derives its split map from these as
    S[l,g] = max(1, round(ratio[l,g] * N_CTA)) (see ``split_map_from_ratios``),
    which equals Algorithm 1 since Phi / tau = Phi * N_CTA / Omega. A layer with
    Omega == 0 stores ratio 0 for every group, giving S = 1 as Algorithm 1 does.
    """
    result = []
    for layer, layer_groups in zip(budgets, groups, strict=True):
        omega = sum(layer)
        phis = [sum(layer[h] for h in group) for group in layer_groups]
        result.append(tuple(phi / omega if omega else 0.0 for phi in phis))
    return tuple(result)


def split_map_from_ratios(
    ratios: Sequence[Sequence[float]], num_ctas: int
) -> tuple[tuple[int, ...], ...]:
    """Split map S[l][g] = max(1, round(ratio[l][g] * N_CTA)) for one device."""
    if num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
    return tuple(tuple(max(1, _round_half_up(r * num_ctas)) for r in layer) for layer in ratios)
