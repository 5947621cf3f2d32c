"""Figures of a profile (``sgl-ragged profile plot``): TANGRAM Figures 5 and 15.

Top row: per-head retention boxes over the calibration samples for a few layers, heads sorted by
their budget, per-task means as markers and the reserved budget B as a dashed tick (Fig. 5).
Bottom: memory reclaimed with and without budget-aware clustering per group size H_p (Fig. 15).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sgl_ragged.cli.summary import PAGE_SIZE, reclaimed_by_group_size
from sgl_ragged.profile import BudgetProfile
from sgl_ragged.sources import source_of

TASK_MARKERS = ("o", "s", "^", "D", "v")


def default_layers(profile: BudgetProfile, count: int = 3) -> list[int]:
    """The ``count`` layers whose budgets differ most across heads (most telling boxes)."""
    spread = [max(row) - min(row) for row in profile.budgets]
    return sorted(sorted(range(len(spread)), key=lambda li: (-spread[li], li))[:count])


def plot_profile(profile: BudgetProfile, out: Path, layers: Sequence[int] | None = None,
                 title: str = "", page_size: int = PAGE_SIZE) -> Path:  # fmt: skip
    """Draw the figure into ``out`` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(layers) if layers else default_layers(profile)
    bad = [li for li in layers if not 0 <= li < profile.num_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist; the profile has {profile.num_layers}")
    fig = plt.figure(figsize=(4.2 * len(layers) + 1, 7.5), layout="constrained")
    grid = fig.add_gridspec(2, len(layers), height_ratios=(3, 2))
    for col, layer in enumerate(layers):
        _retention_panel(fig.add_subplot(grid[0, col]), profile, layer)
    _reclaimed_panel(fig.add_subplot(grid[1, :]), profile, page_size)
    fig.suptitle(title or _title(profile))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _retention_panel(ax, profile: BudgetProfile, layer: int) -> None:  # type: ignore[no-untyped-def]
    budgets = np.asarray(profile.budgets[layer])
    order = np.argsort(budgets, kind="stable")  # heads by budget, ascending
    xs = np.arange(1, len(order) + 1)
    samples = profile.sample_retention
    if samples is not None:
        ret = np.asarray(samples.retention)[:, layer, :]  # [S, H]
        ax.boxplot([ret[:, h] * 100 for h in order], positions=xs, widths=0.5,
                   showfliers=True, flierprops={"markersize": 3})  # fmt: skip
        for i, task in enumerate(sorted(set(samples.tasks))):
            rows = [s for s, t in enumerate(samples.tasks) if t == task]
            ax.scatter(xs + 0.3, ret[rows][:, order].mean(0) * 100, s=14,
                       marker=TASK_MARKERS[i % len(TASK_MARKERS)], label=task, zorder=3)  # fmt: skip
    elif profile.mu is not None:
        ax.scatter(xs, np.asarray(profile.mu[layer])[order] * 100, label="mu", zorder=3)
    ax.hlines(budgets[order] * 100, xs - 0.35, xs + 0.35, colors="red", linestyles="dashed",
              label="reserved B")  # fmt: skip
    ax.set_xticks(xs, [str(h) for h in order])
    ax.set_xlabel("KV head (sorted by budget)")
    ax.set_ylabel("retention (%)")
    ax.set_title(f"layer {layer}")
    ax.legend(fontsize=7, loc="upper left")


def _reclaimed_panel(ax, profile: BudgetProfile, page_size: int) -> None:  # type: ignore[no-untyped-def]
    rows = reclaimed_by_group_size(profile, page_size)
    xs = np.arange(len(rows))
    for shift, label, values in ((-0.2, "adjacent heads", [r.adjacent for r in rows]),
                                 (0.2, "budget-aware clustering", [r.clustered for r in rows])):
        bars = ax.bar(xs + shift, [v * 100 for v in values], 0.4, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(xs, [f"H_p={r.heads_per_group}" for r in rows])
    ax.set_ylabel(f"memory reclaimed (% of full KV, P={page_size})")
    ax.legend(fontsize=8)


def _title(profile: BudgetProfile) -> str:
    model = profile.model.architecture if profile.model else "any model"
    source = source_of(profile.source)
    what = f"{profile.source.kind} profile" if source is None else source.plot_title(profile.source)
    return f"{model}: {what}"
