"""bench.accuracy's report: the markdown tables and the KL plot (bench.offline_loss draws its plot
with ``plot_kl`` too)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.accuracy_configs import FULL


def _flag(z: float) -> str:
    if abs(z) > 2:
        return f"yes, >2 SE (z={z:+.1f})"
    if abs(z) > 1:
        return f"yes, >1 SE (z={z:+.1f})"
    return "no" if math.isnan(z) else f"no (z={z:+.1f})"


def markdown(summaries: list[dict[str, Any]], comps: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"{meta['questions']} questions ({meta['sessions']} sessions x {meta['turns']} turns, "
             f"tasks {', '.join(meta['tasks'])}, ~{meta['context_tokens']}-token contexts, seed "
             f"{meta['seed']}); KL over the top-{meta['top_k']} tokens of full + rest bucket; "
             "mean ± standard error.", "",
             "| config | rho | KV bytes (vs bf16) | exact match | answer-token top-1 | "
             "mean KL(full ‖ config) (nats/token) |",
             "|---|---|---|---|---|---|"]
    for s in summaries:
        e, t, k = s["exact"], s["token_acc"], s["kl"]
        lines.append(f"| {s['name']} | {s['rho']} | {s['bytes']:.3f} | {e['mean']:.3f} ± {e['se']:.3f} | "
                     f"{t['mean']:.3f} ± {t['se']:.3f} | {k['mean']:.4f} ± {k['se']:.4f} |")
    lines += ["", "Paired differences (a − b over the same questions; SE of the per-question "
              "differences; flag: does |Δ| exceed its SE):", "",
              "| rho | a | b | Δ exact | exceeds SE? | Δ top-1 | exceeds SE? | Δ KL | exceeds SE? |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in comps:
        lines.append(f"| {c['rho']} | {c['a']} | {c['b']} | {c['exact_mean']:+.3f} ± {c['exact_se']:.3f} | "
                     f"{_flag(c['exact_z'])} | {c['top1_mean']:+.3f} ± {c['top1_se']:.3f} | "
                     f"{_flag(c['top1_z'])} | {c['kl_mean']:+.4f} ± {c['kl_se']:.4f} | {_flag(c['kl_z'])} |")
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    plot_kl(summaries, path, "bytes", "KV bytes per token (fraction of full bf16)",
            "Next-token KL vs full KV (answer tokens, teacher-forced)", full_at=1.0)


def plot_kl(rows: list[dict[str, Any]], path: Path, x: str, xlabel: str, title: str,
            full_at: float | None = None) -> None:  # fmt: skip
    """Mean KL ± SE of each configuration family (the name before "@") against ``rows[i][x]``;
    ``full_at`` ends every line at the full cache's point (full_at, 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] != FULL:
            families.setdefault(r["name"].split("@")[0], []).append(r)
    tail = [] if full_at is None else [(full_at, 0.0, 0.0)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (name, rs) in enumerate(sorted(families.items())):
        points = sorted((r[x], r["kl"]["mean"], r["kl"]["se"]) for r in rs) + tail
        xs, ys, es = zip(*points, strict=True)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name, color=colors[i % len(colors)])
    # KL spans orders of magnitude (0 for the full cache): linear below 1e-3, log above.
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean KL(full || config), nats/token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
