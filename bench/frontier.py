"""The accuracy frontier in one figure: KL against the full cache and top-1 against KV bytes per
token, from a bench.accuracy run (the server: answer-token top-1) and a bench.offline_loss run
(the emulator: top-1 agreement with the full cache), every configuration a point and every
family (the name before "@": uniform = drop only, int4 = int4 tiers under a bf16 high tier,
int8+int4 = a quantized high tier, sglang-<dtype> = SGLang's own caches, a --profile-config
name such as perhead@0.2, mixed = per-head precision) a line; a black dashed line joins our lowest-KL point per budget.

    python -m bench.frontier --server results/accuracy-frontier-20/accuracy.json \
        results/accuracy-per-head/accuracy.json \
        --offline results/offline-frontier-20/offline_loss.json --out docs/figures/frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NamedTuple

from bench.accuracy_configs import FULL, STOCK

LABELS = {"uniform": "drop (uniform)", "int4": "int4 tiers (bf16 high)", "int2": "int2 tiers (bf16 high)",
          "int2-all": "every token int2", "mixed": "per-head precision (mixed)"}


class Point(NamedTuple):
    family: str
    name: str
    bytes: float
    kl: float
    kl_se: float
    top1: float
    top1_se: float
    stock: bool


def server_points(result: dict[str, Any]) -> list[Point]:
    """bench.accuracy's accuracy.json -> points (top-1: answer-token top-1)."""
    return [Point(s["name"].split("@")[0], s["name"], s["bytes"], s["kl"]["mean"], s["kl"]["se"],
                  s["token_acc"]["mean"], s["token_acc"]["se"], s["kind"] == STOCK)
            for s in result["configs"]]


def offline_points(result: dict[str, Any]) -> list[Point]:
    """bench.offline_loss's offline_loss.json -> points (top-1: agreement with the full cache)."""
    return [Point(r["name"].split("@")[0], r["name"], r["memory"], r["kl"]["mean"], r["kl"]["se"],
                  r["agree"]["mean"], r["agree"]["se"], r["kind"] == STOCK)
            for r in result["configs"]]


def merged(read: Any, paths: list[Path]) -> list[Point]:
    """Every file's points, each config name once (the first file's)."""
    seen: dict[str, Point] = {}
    for path in paths:
        for point in read(json.loads(path.read_text())):
            seen.setdefault(point.name, point)
    return list(seen.values())


def best_per_budget(points: list[Point], budgets: tuple[float, ...] = (0.5, 0.3, 0.2, 0.15),
                    slack: float = 0.02) -> list[Point]:
    """Our lowest-KL point within `slack` bytes above each budget (not SGLang's, not full)."""
    best = []
    for b in budgets:
        ours = [p for p in points if not p.stock and p.family != FULL and p.bytes <= b + slack
                and p.bytes >= b - 0.05]
        if ours:
            best.append(min(ours, key=lambda p: p.kl))
    return sorted(best, key=lambda p: p.bytes)


def draw(panels: list[tuple[str, list[Point], str]], path: Path) -> None:
    """One row per (title, points, top-1 label): KL (symlog) and top-1 against bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.6 * len(panels)), squeeze=False)
    families = sorted({p.family for _, pts, _ in panels for p in pts if p.family != FULL})
    palette = (*plt.get_cmap("tab10").colors, *plt.get_cmap("Dark2").colors) * 2  # 18 distinct
    colors = dict(zip(families, palette, strict=False))
    for (title, points, top1_label), (ax_kl, ax_top) in zip(panels, axes, strict=True):
        full = [p for p in points if p.family == FULL]
        for fam in families:
            pts = sorted((p for p in points if p.family == fam), key=lambda p: p.bytes)
            if not pts:
                continue
            style = {"marker": "s" if pts[0].stock else "o", "capsize": 3, "color": colors[fam],
                     "label": LABELS.get(fam, fam), "linestyle": "none" if pts[0].stock else "-"}
            ax_kl.errorbar([p.bytes for p in pts], [p.kl for p in pts], yerr=[p.kl_se for p in pts], **style)
            ax_top.errorbar([p.bytes for p in pts], [p.top1 for p in pts],
                            yerr=[p.top1_se for p in pts], **style)
        best = best_per_budget(points)
        for ax, ys in ((ax_kl, [p.kl for p in best]), (ax_top, [p.top1 for p in best])):
            ax.plot([p.bytes for p in best], ys, "k--", lw=1, label="ours, lowest KL per budget")
        if full:
            ax_top.axhline(full[0].top1, color="grey", lw=1, ls=":", label="full")
        ax_kl.set_yscale("symlog", linthresh=1e-3)
        ax_kl.set_ylabel("mean KL(full || config), nats/token")
        ax_top.set_ylabel(top1_label)
        for ax in (ax_kl, ax_top):
            ax.set_xlabel("KV bytes per token (fraction of full bf16)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        ax_top.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", type=Path, nargs="+", default=None,
                   help="bench.accuracy's accuracy.json (several: runs over the same questions, "
                        "a config name drawn once, from the first file that has it)")
    p.add_argument("--offline", type=Path, nargs="+", default=None,
                   help="bench.offline_loss's offline_loss.json (several: as --server)")
    p.add_argument("--out", type=Path, default=Path("docs/figures/frontier.png"))
    args = p.parse_args(argv)
    panels = []
    if args.server:
        panels.append(("Server (bf16, answer tokens, teacher-forced)",
                       merged(server_points, args.server), "answer-token top-1"))
    if args.offline:
        panels.append(("Offline (prefill compression, held-out samples)",
                       merged(offline_points, args.offline), "top-1 agreement with full"))
    if not panels:
        p.error("give --server and/or --offline")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(panels, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
