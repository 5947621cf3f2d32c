"""Tensor parallelism: each rank's slice of a budget profile (docs/architecture.md, "Scaling out").

SGLang's tensor parallelism (`--tp-size T`) gives rank r the contiguous KV heads
`[r * H / T, (r + 1) * H / T)` of every layer. Each rank stores only those, so it serves a
slice of the whole-model profile: their budgets, head groups formed within the rank (a group
never straddles ranks), and split ratios over the rank's own heads (its AOT split map).
Calibrated profiles stay whole-model files; slicing happens at load.

Ranks may then differ in bytes per logical page, but SGLang admits requests by one logical
token count for all ranks, so every rank computes every rank's slice and takes the smallest
capacity (`agreed_logical_pages`): no communication, the same answer on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import sgl_ragged.budgets as budget_math
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.pp import slice_layers
from sgl_ragged.profile import (
    BudgetProfile,
    ModelShape,
    ProfileError,
    resolve_profile,
)

TP_SOURCE_KEY = "tensor_parallel"  # source entry of a sliced profile: {size, rank, heads}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_size(num_kv_heads: int, tp_size: int) -> int:
    """KV heads per rank; ProfileError unless ``tp_size`` divides the KV heads."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ProfileError(f"--tp-size must be a positive int, got {tp_size!r}")
    if num_kv_heads % tp_size != 0:
        raise ProfileError(
            f"--tp-size {tp_size} does not divide the model's {num_kv_heads} KV heads: the ragged "
            "backend stores each KV head (and its budget) on exactly one rank, so every rank "
            f"must hold the same number of whole heads; use --tp-size in {_divisors(num_kv_heads)} "
            "(or data parallelism: --dp-size, or replicas behind sglang_router)"
        )
    return num_kv_heads // tp_size


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, ...]:
    """Global KV-head indices rank ``rank`` stores, ascending (SGLang's contiguous split)."""
    local = check_tp_size(num_kv_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise ProfileError(f"tensor-parallel rank {rank} is outside [0, {tp_size})")
    return tuple(range(rank * local, (rank + 1) * local))


def rank_group_size(profile: BudgetProfile, local_heads: int, heads_per_group: int | None) -> int:
    """H_p of every rank's groups: the explicit --ragged-heads-per-group, else one group of the
    rank's heads for model-free profiles (uniform, dynamic), else the profile's H_p.
    ProfileError if it does not divide the rank's heads (a group would straddle ranks)."""
    if heads_per_group is not None:
        size, what = heads_per_group, f"--ragged-heads-per-group {heads_per_group}"
    elif profile.source.fits_any_model:
        return local_heads
    else:
        size, what = profile.heads_per_group, f"the profile's head groups of {profile.heads_per_group}"
    if local_heads % size != 0:
        raise ProfileError(
            f"{what} cannot be formed on each tensor-parallel rank, which holds {local_heads} of "
            f"the {profile.num_kv_heads} KV heads: a head group must lie within one rank; pass "
            f"--ragged-heads-per-group in {_divisors(local_heads)} or a smaller --tp-size"
        )
    return size


def slice_profile(profile: BudgetProfile, tp_size: int, rank: int,
                  heads_per_group: int | None = None) -> BudgetProfile:
    """Rank ``rank``'s profile over its local heads 0..H/T-1 (global head = heads[local]).

    Per layer, the profile's groups are kept if each lies within the rank's heads and has
    the rank's group size; otherwise the rank's heads are clustered by budget
    (budgets.cluster_heads). Split ratios are recomputed over the rank's heads; row tiers (and
    per-head formats) are the rank's heads' own.
    """
    heads = rank_heads(profile.num_kv_heads, tp_size, rank)
    size = rank_group_size(profile, len(heads), heads_per_group)
    budgets = tuple(tuple(layer[h] for h in heads) for layer in profile.budgets)
    groups = tuple(_rank_groups(layer_groups, layer_budgets, heads, size)
                   for layer_groups, layer_budgets in zip(profile.groups, budgets, strict=True))
    if profile.tiers is not None:
        _check_tiers_keep_groups(profile, groups, heads, tp_size)

    def pick(matrix: Sequence[Sequence[float]] | None) -> tuple[tuple[float, ...], ...] | None:
        return None if matrix is None else tuple(tuple(row[h] for h in heads) for row in matrix)

    model = profile.model
    if model is not None:
        model = dataclasses.replace(model, num_kv_heads=len(heads))
    ratios = None if profile.split_ratios is None else budget_math.split_ratios(budgets, groups)
    source = profile.source.updated({TP_SOURCE_KEY: {"size": tp_size, "rank": rank, "heads": list(heads)}})
    stats = {k: v for k, v in profile.stats.items() if k != "samples"}  # [S][L][H]: whole model
    tiers = profile.tiers and dataclasses.replace(  # each head's composition (and format)
        profile.tiers, hi=pick(profile.tiers.hi), lo=pick(profile.tiers.lo),
        formats=profile.tiers.formats and pick(profile.tiers.formats))
    return BudgetProfile(model, budgets, groups, source, pick(profile.mu), pick(profile.sigma),
                         ratios, stats, tiers)


def _rank_groups(layer_groups: Sequence[Sequence[int]], local_budgets: Sequence[float],
                 heads: tuple[int, ...], size: int) -> tuple[tuple[int, ...], ...]:
    """[G_r][H_p] local head indices of one layer's groups on a rank."""
    local = {h: i for i, h in enumerate(heads)}
    mine = [g for g in layer_groups if any(h in local for h in g)]
    if all(len(g) == size and all(h in local for h in g) for g in mine):
        return tuple(tuple(local[h] for h in g) for g in mine)
    return budget_math.cluster_heads(local_budgets, size)


def _check_tiers_keep_groups(profile: BudgetProfile, groups: Sequence[Sequence[Sequence[int]]],
                             heads: tuple[int, ...], tp_size: int) -> None:
    """ProfileError where a rank re-formed a layer's head groups although the profile's row tiers
    (and per-head formats) were searched per group: a group shares one row composition."""
    for li, (mine, whole) in enumerate(zip(groups, profile.groups, strict=True)):
        kept = {tuple(heads[h] for h in g) for g in mine} <= {tuple(g) for g in whole}
        if not kept:
            raise ProfileError(
                f"this profile carries row tiers (tiers {profile.tiers.precision!r}) searched for "
                f"its head groups, but at layer {li} its groups {[list(g) for g in whole]} cannot "
                f"be kept on the --tp-size {tp_size} rank holding heads {list(heads)} (a group "
                "must lie within one rank and have the rank's group size), and re-formed groups "
                "would lose the tiers; search tiers on a profile whose groups lie within the "
                "ranks' heads, leave --ragged-heads-per-group unset, or serve it with --tp-size 1"
            )


def slice_all(profile: BudgetProfile, tp_size: int,
              heads_per_group: int | None = None) -> tuple[BudgetProfile, ...]:
    """Every rank's slice, rank 0 first."""
    return tuple(slice_profile(profile, tp_size, r, heads_per_group) for r in range(tp_size))


def resolve_rank_profiles(spec: str, shape: ModelShape, heads_per_group: int | None,
                          tp_size: int, layers: tuple[int, int] | None = None,
                          ) -> tuple[BudgetProfile, ...]:
    """A --ragged-profile value resolved for the whole model (``shape``), cut to a pipeline
    stage's layers ``[start, end)`` where given (pp.py), then sliced per rank.

    With tp_size 1 this is ``(resolve_profile(spec, shape, heads_per_group),)`` (of the stage's
    layers). Otherwise the whole-model profile keeps its own groups (they are re-formed per
    rank) and ``heads_per_group`` applies to each rank's heads.
    """
    def stage(profile: BudgetProfile) -> BudgetProfile:
        return profile if layers is None else slice_layers(profile, *layers)

    if tp_size == 1:
        return (stage(resolve_profile(spec, shape, heads_per_group)),)
    check_tp_size(shape.num_kv_heads, tp_size)
    whole = resolve_profile(spec, shape)
    if whole.source.is_dynamic:
        raise ProfileError(
            f"--ragged-profile {spec} (the dynamic reference mode) selects tokens over all KV "
            f"heads of a layer at once (Eq. 3), but with --tp-size {tp_size} each rank holds only "
            "its own heads; run the reference with --tp-size 1"
        )
    return slice_all(stage(whole), tp_size, heads_per_group)


def agreed_logical_pages(layouts: Sequence[RaggedLayout], available_bytes: int,
                         num_staging_pages: int) -> int:
    """Logical pages every rank admits: the smallest of the ranks' capacities at the same KV
    bytes (SGLang schedules one logical token count for all ranks; none may run out first)."""
    if not layouts:
        raise ValueError("no tensor-parallel ranks")
    return min(layout.num_logical_pages(available_bytes, num_staging_pages) for layout in layouts)


def agreed_cell_size(layouts: Sequence[RaggedLayout]) -> int:
    """Bytes per logical token SGLang sizes the pool with: the largest over ranks, rounded up
    (a cell size never admits more than the rank with the widest rows holds)."""
    return max(-(-layout.row_bytes_per_page // layout.page_size) for layout in layouts)
