"""A readable summary of a budget profile (``sgl-ragged profile show``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sgl_ragged import budgets as budget_math
from sgl_ragged.profile import BudgetProfile
from sgl_ragged.sources import BudgetSource, SourceRecord, source_of

PAGE_SIZE = 64  # serving's default logical page (the compression block)
GROUP_SIZES = (1, 2, 4)  # H_p compared in the memory table, plus H (one group per layer)


class Reclaimed(NamedTuple):
    """Memory reclaimed (fraction of the full KV cache) at one group size H_p (TANGRAM Fig. 15)."""

    heads_per_group: int
    clustered: float  # budget-aware clustering
    adjacent: float  # heads grouped by index


def reclaimed_by_group_size(profile: BudgetProfile, page_size: int = PAGE_SIZE) -> list[Reclaimed]:
    """1 - (ragged bytes / full bytes) for each H_p in {1, 2, 4, H} that divides H."""
    h = profile.num_kv_heads
    sizes = sorted({s for s in (*GROUP_SIZES, h) if h % s == 0})
    rows = []
    for hp in sizes:
        clustered = [budget_math.cluster_heads(layer, hp) for layer in profile.budgets]
        adjacent = [budget_math.adjacent_groups(h, hp)] * profile.num_layers
        rows.append(Reclaimed(hp, *(
            1.0 - budget_math.group_memory_fraction(profile.budgets, g, page_size)
            for g in (clustered, adjacent)
        )))  # fmt: skip
    return rows


def describe(profile: BudgetProfile, name: str, page_size: int = PAGE_SIZE) -> str:
    """Multi-line summary: model, source, budgets, memory, per-layer table, regularity."""
    fraction = budget_math.group_memory_fraction(profile.budgets, profile.groups, page_size)
    lines = [
        f"profile    {name}",
        f"model      {profile.model.describe() if profile.model else 'any (model-free)'}",
        f"source     {_source(profile.source)}",
        f"budgets    mean B {profile.mean_budget:.3f}" + _mu_note(profile)
        + f"; B in [{_min(profile.budgets):.3f}, {_max(profile.budgets):.3f}]",
        f"groups     H_p = {profile.heads_per_group} ({profile.num_groups} per layer)",
        f"memory     {fraction:.3f} of full KV at page size {page_size} (slots rounded up, >= 4 "
        f"sinks): capacity gain x{1.0 / fraction:.2f}",
        "reclaimed  " + "; ".join(
            f"H_p={r.heads_per_group}: {r.clustered:.1%} clustered, {r.adjacent:.1%} adjacent"
            for r in reclaimed_by_group_size(profile, page_size)),
        "",
        *_layer_table(profile, page_size),
    ]  # fmt: skip
    if profile.tiers is not None:
        lines[7:7] = [_tiers_line(profile, page_size)]
    lines += _stats_lines(profile.stats, source_of(profile.source))
    return "\n".join(lines)


def _tiers_line(profile: BudgetProfile, page_size: int) -> str:
    """The stored row compositions (used with --ragged-precision <their precision>)."""
    t = profile.tiers
    hi = sum(map(sum, t.hi)) / (profile.num_layers * profile.num_kv_heads) * page_size
    lo = sum(map(sum, t.lo)) / (profile.num_layers * profile.num_kv_heads) * page_size
    search = profile.stats.get("tier_search", {})
    chosen = f", searched: {search['chosen']}" if "chosen" in search else ""
    low = t.precision
    if t.formats is not None:  # per-head formats: how many heads keep a low tier in each
        used = [f for f_row, lo_row in zip(t.formats, t.lo, strict=True)
                for f, share in zip(f_row, lo_row, strict=True) if share > 0]
        low = "low (heads: " + ", ".join(f"{used.count(n)} {n}" for n in sorted(set(used))) + ")"
    rotation = f" --ragged-rotation {t.rotation}" if t.rotated else ""
    return (f"tiers      --ragged-precision {t.precision}{rotation}: mean {hi:.1f} full + "
            f"{lo:.1f} {low} slots per page of {page_size}{chosen}")


def _source(record: SourceRecord) -> str:
    source = source_of(record)
    if source is None:  # model-free (uniform, dynamic) or written by no registered source
        return ", ".join(f"{k} {v}" for k, v in record.items())
    return source.describe(record)


def _mu_note(profile: BudgetProfile) -> str:
    if profile.mu is None:
        return ""
    mean_mu = sum(map(sum, profile.mu)) / (profile.num_layers * profile.num_kv_heads)
    return f" (mean retention mu {mean_mu:.3f} before the margin)"


def _layer_table(profile: BudgetProfile, page_size: int) -> list[str]:
    slots = profile.slots_per_group(page_size)
    lines = [f"layer  B min  B max  groups (heads: slots of {page_size})"]
    for li, (row, groups) in enumerate(zip(profile.budgets, profile.groups, strict=True)):
        groups_text = "  ".join(
            f"{','.join(map(str, g))}:{k}" for g, k in zip(groups, slots[li], strict=True)
        )
        lines.append(f"{li:>5}  {min(row):.3f}  {max(row):.3f}  {groups_text}")
    return lines


def _stats_lines(stats: dict[str, Any], source: BudgetSource | None) -> list[str]:
    lines = []
    rank = stats.get("rank_stability")
    if isinstance(rank, dict):
        lines += [
            "",
            "rank stability (Spearman of per-head retention)",
            f"  across samples: {_f(rank.get('samples_global_mean'))} mean over sample pairs "
            f"(min {_f(rank.get('samples_global_min'))}) over all (layer, head); "
            f"{_f(rank.get('samples_within_layer_mean'))} within layers",
            "  across tasks:   " + _pairs(rank.get("tasks_global", {}))
            + " (all heads); " + _pairs(rank.get("tasks_within_layer", {})) + " (within layers)",
        ]  # fmt: skip
    elif rank is not None:
        lines.append(f"rank stability {rank}")
    cover = stats.get("coverage")
    if isinstance(cover, dict):
        worst = cover.get("worst_head", {})
        lines += [
            f"coverage   {_pct(cover.get('overall'))} of (sample, head) within B "
            f"(by task: {', '.join(f'{t} {_pct(v)}' for t, v in cover.get('by_task', {}).items())}); "
            f"held out {_pct(cover.get('held_out'))}; samples fully covered "
            f"{_pct(cover.get('samples_fully_covered'))}",
            f"           worst head L{worst.get('layer')} H{worst.get('head')} "
            f"{_pct(worst.get('coverage'))}; overflow mean {_f(cover.get('mean_overflow'))}, "
            f"max {_f(cover.get('max_overflow'))}",
        ]
    elif cover is not None:
        lines.append(f"coverage   {cover}")
    if source is not None:
        lines += source.summary_lines(stats)
    run = stats.get("run")
    if isinstance(run, dict):
        lines.append(f"run        {run.get('seconds')} s on {run.get('device')} "
                     f"({run.get('threads')} threads) for {run.get('profiles')} profile(s)")  # fmt: skip
    return lines


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {_f(v)}" for k, v in values.items()) or "n/a"


def _f(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _min(rows: Sequence[Sequence[float]]) -> float:
    return min(min(r) for r in rows)


def _max(rows: Sequence[Sequence[float]]) -> float:
    return max(max(r) for r in rows)
