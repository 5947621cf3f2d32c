"""Budgets from per-sample retention (TANGRAM Eq. 5) and the regularity statistics of section 3.2.

Input everywhere: ``retention`` [S, L, H] float, the retention ratio of each (sample, layer, KV
head) under Eq. 3. Rank stability is Spearman's rank correlation (ties get average ranks) of
per-head retention between two samples, or between the mean profiles of two task types, taken
over all (layer, head) pairs ("global") and within each layer ("within_layer", averaged over
layers). Coverage is how often a sample's retention stays within the reserved budget B.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

BUDGET_FLOOR = 1e-3  # B of a head that kept nothing (a profile budget must be > 0)


def mean_and_std(retention: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[S, L, H] -> mu, sigma [L, H]; sigma is the sample standard deviation (0 for S = 1)."""
    ddof = 1 if retention.shape[0] > 1 else 0
    return retention.mean(0), retention.std(0, ddof=ddof)


def reserved_budgets(mu: np.ndarray, sigma: np.ndarray, alpha: float) -> np.ndarray:
    """Eq. 5: B = min(1, mu + alpha * sigma), floored at BUDGET_FLOOR. [L, H]."""
    return np.clip(mu + alpha * sigma, BUDGET_FLOOR, 1.0)


BUDGET_MODES = ("margin", "mean")
"""margin: B = min(1, mu + alpha * sigma) with the given alpha (Eq. 5, the paper's rule);
mean: the same rule with the alpha at which the mean of B is rho (docs/calibration.md)."""


def mean_matched_alpha(mu: np.ndarray, sigma: np.ndarray, rho: float) -> float:
    """The margin alpha at which mean(reserved_budgets(mu, sigma, alpha)) = rho: a heavier
    margin where heads are clipped at 1 (their share goes to the others), a negative one where
    the mean retention alone exceeds rho. The mean is monotone in alpha: bisection."""

    def mean_at(alpha: float) -> float:
        return float(reserved_budgets(mu, sigma, alpha).mean())

    lo, hi = -1.0, 1.0
    while mean_at(lo) > rho or mean_at(hi) < rho:
        lo, hi = (2 * lo, hi) if mean_at(lo) > rho else (lo, 2 * hi)
        if max(-lo, hi) > 1e6:
            reach = (mean_at(-1e9), mean_at(1e9))
            raise ValueError(
                f"no margin gives a mean budget of {rho}: the budgets' mean only spans "
                f"[{reach[0]:.4f}, {reach[1]:.4f}] (heads whose retention never varied keep "
                "their mean); pick a rho inside it or use --budget-mode margin"
            )
    for _ in range(100):  # hi - lo shrinks below 1e-20 of the bracket
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_at(mid) < rho else (lo, mid)
    return hi


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n along the last axis; tied values share the mean of their ranks."""
    x = np.asarray(x, dtype=np.float64)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    for row, dest in zip(flat, out, strict=True):
        order = np.argsort(row, kind="stable")
        ranks = np.empty(len(row))
        ranks[order] = np.arange(1, len(row) + 1)
        # Tied values: every member gets the mean rank of its tie group.
        _, inverse, counts = np.unique(row, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=ranks)
        dest[:] = sums[inverse] / counts[inverse]
    return out.reshape(x.shape)


def spearman_matrix(values: np.ndarray) -> np.ndarray:
    """values [K, n] -> [K, K] Spearman correlations of the rows; NaN where a row is constant."""
    ranks = average_ranks(values)
    centred = ranks - ranks.mean(-1, keepdims=True)
    norms = np.sqrt((centred**2).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (centred @ centred.T) / np.outer(norms, norms)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (NaN if one is constant)."""
    return float(spearman_matrix(np.stack([np.asarray(x, float), np.asarray(y, float)]))[0, 1])


def rank_stability(retention: np.ndarray, tasks: Sequence[str]) -> dict[str, Any]:
    """Spearman rank stability of per-head retention across samples and across task types."""
    samples, layers, _ = retention.shape
    pairs = np.triu_indices(samples, k=1)
    global_corr = spearman_matrix(retention.reshape(samples, -1))[pairs]
    per_layer = [_nanmean(spearman_matrix(retention[:, li])[pairs]) for li in range(layers)]
    task_names = sorted(set(tasks))
    task_means = {t: retention[[i for i, s in enumerate(tasks) if s == t]].mean(0) for t in task_names}
    tasks_global, tasks_layer = {}, {}
    for a, b in itertools.combinations(task_names, 2):
        tasks_global[f"{a}/{b}"] = _num(spearman(task_means[a].ravel(), task_means[b].ravel()))
        layer_corr = [spearman(task_means[a][li], task_means[b][li]) for li in range(layers)]
        tasks_layer[f"{a}/{b}"] = _num(_nanmean(layer_corr))
    return {
        "samples_global_mean": _num(_nanmean(global_corr)),
        "samples_global_min": _num(_nanmean(global_corr, np.nanmin)),
        "samples_within_layer_mean": _num(_nanmean(per_layer)),
        "samples_within_layer_by_layer": [_num(x) for x in per_layer],
        "tasks_global": tasks_global,
        "tasks_within_layer": tasks_layer,
    }


def coverage(retention: np.ndarray, budgets: np.ndarray, tasks: Sequence[str]) -> dict[str, Any]:
    """How often a sample's per-head retention stays within B, and by how much it overflows."""
    covered = retention <= budgets[None] + 1e-6  # [S, L, H]; B has 6 decimals
    per_head = covered.mean(0)  # [L, H]
    worst = np.unravel_index(int(np.argmin(per_head)), per_head.shape)
    overflow = np.maximum(retention - budgets[None], 0.0)
    return {
        "overall": _num(covered.mean()),
        "by_task": {t: _num(covered[[i for i, s in enumerate(tasks) if s == t]].mean())
                    for t in sorted(set(tasks))},  # fmt: skip
        "samples_fully_covered": _num(covered.all(axis=(1, 2)).mean()),
        "worst_head": {"layer": int(worst[0]), "head": int(worst[1]),
                       "coverage": _num(per_head[worst])},  # fmt: skip
        "mean_overflow": _num(overflow.mean()),
        "max_overflow": _num(overflow.max()),
    }


def held_out_coverage(retention: np.ndarray, alpha: float) -> float | None:
    """Coverage on the odd samples of budgets calibrated on the even ones (None if S < 2)."""
    if retention.shape[0] < 2:
        return None
    mu, sigma = mean_and_std(retention[0::2])
    held_out = retention[1::2] <= reserved_budgets(mu, sigma, alpha)[None] + 1e-12
    return _num(held_out.mean())


def _num(x: float) -> float | None:
    """A JSON-safe rounded float (None for NaN: undefined, e.g. a constant ranking)."""
    x = float(x)
    return None if np.isnan(x) else round(x, 4)


def _nanmean(values: Any, reduce: Any = np.nanmean) -> float:
    """``reduce`` (nanmean) of the defined values; NaN, without a warning, when there are none."""
    values = np.asarray(values, dtype=np.float64)
    if not np.isfinite(values).any():
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(reduce(values))
