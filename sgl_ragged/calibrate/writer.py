"""Turn recorded retention into a budget profile file (TANGRAM sections 4.1-4.3).

Budgets B = min(1, mu + alpha * sigma) (Eq. 5), budget-aware clustering into groups of H_p
heads (section 4.2.2), the device-independent AOT split ratios (Algorithm 1), the source
metadata and the regularity statistics, including the per-sample retention itself (for plots).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sgl_ragged import budgets as budget_math
from sgl_ragged.calibrate import statistics
from sgl_ragged.profile import STATS_SCHEMA, BudgetProfile, ModelShape

DIGITS = 6  # decimals kept for B, mu, sigma
SAMPLE_DIGITS = 4  # decimals kept for per-sample retention


def build_profile(
    shape: ModelShape, retention: np.ndarray, tasks: Sequence[str], tokens: Sequence[int],
    alpha: float, heads_per_group: int, source: dict[str, Any], extra_stats: dict[str, Any],
) -> BudgetProfile:  # fmt: skip
    """A calibrated profile from ``retention`` [S, L, H] (one scorer, one rho)."""
    # 1. Eq. 5 per head.
    mu, sigma = statistics.mean_and_std(retention)
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
        source=source,
        mu=np.round(mu, DIGITS).tolist(),
        sigma=np.round(sigma, DIGITS).tolist(),
        split_ratios=ratios,
        stats=stats,
    )


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
