"""bench.accuracy's scores: per configuration (exact match, answer-token top-1, KL, each ± SE) and
paired differences between configurations over the same questions."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.accuracy_configs import STOCK, Config, other_sources, split_rotated
from bench.accuracy_stats import binomial_se, paired_diff
from sgl_ragged.stats import mean_se

SCORED_TASKS = ("kv", "needle", "code")


def summarize(config: Config, records: list[dict[str, Any]], kv_bytes: float) -> dict[str, Any]:
    acc = binomial_se(sum(r["exact"] for r in records), len(records))
    kl = mean_se([r["kl"] for r in records])
    by_task = {t: binomial_se(sum(r["exact"] for r in rs), len(rs))._asdict()
               for t in SCORED_TASKS if (rs := [r for r in records if r["task"] == t])}
    return {**asdict(config), "bytes": kv_bytes, "exact": acc._asdict(), "kl": kl._asdict(), "exact_by_task": by_task,
            "token_acc": mean_se([sum(r["top1"]) / len(r["top1"]) for r in records])._asdict(),
            "kl_token_mean": mean_se([x for r in records for x in r["kl_tokens"]]).mean}


def comparisons(configs: list[Config], records: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """static vs dynamic (same scorer and rho) and static vs uniform (same rho); static-mean
    (equal memory) vs uniform, dynamic and static; kvcompose and baklava (equal memory) vs
    uniform and static-mean; row tiers vs uniform, and a quantized high tier (h+l@rho) vs int4
    tiers too; a rotated precision (int4r@0.3, mixedr@0.3) vs its unrotated twin; paired over
    the same questions."""
    by_name = {c.name: c for c in configs if c.name in records}
    versus = {"static": ("dynamic-{s}@{r}", "uniform@{r}"),
              "static-mean": ("uniform@{r}", "dynamic-{s}@{r}", "static-{s}@{r}"),
              **{source: ("uniform@{r}", "static-mean-{s}@{r}") for source in other_sources()},
              "tiers": ("uniform@{r}",),
              "tiers-mixed": ("uniform@{r}", "int4@{r}")}  # vs int4 tiers with a bf16 high tier
    pairs = []
    for c in by_name.values():
        for other in versus.get(c.kind, ()):
            other = other.format(s=c.scorer, r=c.rho)
            if other in by_name:
                pairs.append((c.name, other))
        twin = rotated_twin(c)
        if twin in by_name:
            pairs.append((c.name, twin))
    out = []
    for a, b in pairs:
        ra, rb = records[a], records[b]
        key = [(r["session"], r["turn"]) for r in ra]
        if key != [(r["session"], r["turn"]) for r in rb]:
            raise ValueError(f"{a} and {b} were run on different questions; rerun without --resume")
        d_acc = paired_diff([float(r["exact"]) for r in ra], [float(r["exact"]) for r in rb])
        d_tok = paired_diff([sum(r["top1"]) / len(r["top1"]) for r in ra],
                            [sum(r["top1"]) / len(r["top1"]) for r in rb])
        d_kl = paired_diff([r["kl"] for r in ra], [r["kl"] for r in rb])
        out.append({"a": a, "b": b, "rho": by_name[a].rho,
                    **{f"exact_{k}": v for k, v in d_acc._asdict().items()},
                    "exact_z": d_acc.z, "exact_exceeds_se": d_acc.exceeds_se,
                    "top1_mean": d_tok.mean, "top1_se": d_tok.se, "top1_z": d_tok.z,
                    **{f"kl_{k}": v for k, v in d_kl._asdict().items()},
                    "kl_z": d_kl.z, "kl_exceeds_se": d_kl.exceeds_se, "kl_exceeds_2se": d_kl.exceeds_2se})
    return out


def rotated_twin(config: Config) -> str | None:
    """The name of a rotated configuration's unrotated twin ("int4r@0.3" -> "int4@0.3",
    "mixedr@0.3" -> "mixed@0.3"), None for an unrotated one or a name not led by its precision."""
    if config.kind == STOCK or not config.name.startswith(config.precision):
        return None
    base, rotated = split_rotated(config.precision)
    return base + config.name[len(config.precision):] if rotated else None
