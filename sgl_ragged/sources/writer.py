"""Turn recorded retention into a budget profile file (TANGRAM sections 4.1-4.3).

Budgets B = min(1, mu + alpha * sigma) (Eq. 5; in mean mode alpha is the margin that makes the
mean budget rho, docs/calibration.md), budget-aware clustering into groups of H_p
heads (section 4.2.2), the device-independent AOT split ratios (Algorithm 1), the source
metadata and the regularity statistics, including the per-sample retention itself (for plots).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sgl_ragged import budgets as budget_math
from sgl_ragged.profile import STATS_SCHEMA, BudgetProfile, ModelShape
from sgl_ragged.profile.source import SourceRecord
from sgl_ragged.sources import statistics

DIGITS = 6  # decimals kept for B, mu, sigma
SAMPLE_DIGITS = 4  # decimals kept for per-sample retention


def build_profile(
    shape: ModelShape, retention: np.ndarray, tasks: Sequence[str], tokens: Sequence[int],
    alpha: float, heads_per_group: int, source: SourceRecord | Mapping[str, Any],
    extra_stats: dict[str, Any],
    budget_mode: str = "margin",
) -> BudgetProfile:  # fmt: skip
    """A calibrated profile from ``retention`` [S, L, H] (one scorer, one rho = source.rho).
    budget_mode (statistics.BUDGET_MODES): "mean" replaces alpha by the margin at which the
    mean budget is rho; the source records the alpha used and the mode."""
    if budget_mode not in statistics.BUDGET_MODES:
        raise ValueError(f"budget mode must be one of {statistics.BUDGET_MODES}, got {budget_mode!r}")
    record = SourceRecord.of(source)
    # 1. Eq. 5 per head (in mean mode with the margin that makes the mean budget rho).
    mu, sigma = statistics.mean_and_std(retention)
    if budget_mode == "mean":
        alpha = statistics.mean_matched_alpha(mu, sigma, record.rho)
    record = record.updated({"alpha": round(alpha, DIGITS), "budget_mode": budget_mode})
    budgets = np.round(statistics.reserved_budgets(mu, sigma, alpha), DIGITS)
    # 2. Budget-aware clustering and the AOT split ratios of the clustered groups.
    groups = tuple(budget_math.cluster_heads(row, heads_per_group) for row in budgets.tolist())
    ratios = budget_math.split_ratios(budgets.tolist(), groups)
    # 3. Regularity statistics, and the samples themselves.
    stats = {
        "schema": STATS_SCHEMA,
        "mean_retention": round(float(mu.mean()), DIGITS),
        "mean_budget": round(float(budgets.mean()), DIGITS),
        "rank_stability": statistics.rank_stability(retention, tasks),
        "coverage": {**statistics.coverage(retention, budgets, tasks),
                     "held_out": statistics.held_out_coverage(retention, alpha)},
        **extra_stats,
        "samples": {
            "tasks": list(tasks),
            "tokens": [int(t) for t in tokens],
            "retention": np.round(retention, SAMPLE_DIGITS).tolist(),
        },
    }
    return BudgetProfile(
        model=shape,
        budgets=budgets.tolist(),
        groups=groups,
        source=record,
        mu=np.round(mu, DIGITS).tolist(),
        sigma=np.round(sigma, DIGITS).tolist(),
        split_ratios=ratios,
        stats=stats,
    )


def rebuild_profile(profile: BudgetProfile, alpha: float, heads_per_group: int,
                    budget_mode: str, derived_from: str) -> BudgetProfile:
    """The profile a calibration with these settings would have written, from the per-sample
    retention a calibrated profile stores (no model run): another margin, budget mode or group
    size. The caller checks that a margin source wrote ``profile`` (sources.derivable)."""
    samples = profile.stats.get("samples")
    if not samples or profile.model is None:
        raise ValueError(f"{derived_from} is not a calibrated profile with its samples")
    kept = {k: v for k, v in profile.stats.items() if k == "run"}
    return build_profile(
        profile.model, np.asarray(samples["retention"], dtype=np.float64), samples["tasks"],
        samples["tokens"], alpha, heads_per_group, profile.source,
        {**kept, "derived_from": derived_from}, budget_mode,
    )  # fmt: skip


def output_paths(pattern: str, scorers: Sequence[str], rhos: Sequence[float]) -> dict[tuple[str, float], Path]:
    """File of each (scorer, rho); ``pattern`` may use {scorer} and {rho} (e.g. 0.3)."""
    fields = {name for _, name, _, _ in string.Formatter().parse(pattern) if name}
    unknown = fields - {"scorer", "rho"}
    if unknown:
        raise ValueError(f"output pattern {pattern!r} uses {sorted(unknown)}; only {{scorer}} and {{rho}} exist")
    if len(scorers) > 1 and "scorer" not in fields:
        raise ValueError(f"several scorers need {{scorer}} in the output pattern, got {pattern!r}")
    if len(rhos) > 1 and "rho" not in fields:
        raise ValueError(f"several ratios need {{rho}} in the output pattern, got {pattern!r}")
    return {(s, r): Path(pattern.format(scorer=s, rho=f"{r:g}")) for s in scorers for r in rhos}


def save(profile: BudgetProfile, path: Path) -> None:
    """Write ``profile`` to ``path``, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
