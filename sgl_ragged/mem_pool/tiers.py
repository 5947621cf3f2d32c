"""How a group's byte budget per page is spent: tokens at the model dtype, tokens at a low
precision, the rest dropped (DESIGN.md section 11).

The budget of a group is what `k` full-precision slots cost (k = clamp(ceil(B * P), sinks, P),
the drop-only layout's slots), so a precision never costs more bytes than dropping alone.

The default rule (`compose`), from the offline frontier (docs/results.md, "Precision before
dropping"): keeping every token at the low precision beats dropping at equal bytes by ~20x in
KL, and upgrading the page's best tokens to full precision with what is left helps further; so

1. if all P tokens fit at the low precision, keep them all, then upgrade the best ones (by the
   scorer, sinks first) to the model dtype while the bytes allow;
2. else keep as many tokens as fit at the low precision (the best ones) and drop the rest:
   below what the low tier of a whole page costs, dropping on top of it beats a coarser format.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_ragged.precision import LowPrecision


@dataclass(frozen=True)
class RowTiers:
    """Slots per page of one group's row: `hi` at the model dtype, then `lo` quantized."""

    hi: int
    lo: int = 0

    @property
    def total(self) -> int:
        return self.hi + self.lo


def tier_bytes(tiers: RowTiers, fmt: LowPrecision | None, heads: int, head_dim: int,
               dtype_bytes: int) -> int:
    """Bytes of K+V one page's row takes in one group of `heads` heads."""
    full = 2 * tiers.hi * heads * head_dim * dtype_bytes
    if tiers.lo == 0:
        return full
    if fmt is None:
        raise ValueError("a row with a low tier needs a low precision")
    return full + fmt.tier_bytes(tiers.lo, heads, head_dim)


def compose(slots: int, page_size: int, head_dim: int, dtype_bytes: int,
            fmt: LowPrecision | None, min_slots: int) -> RowTiers:
    """The default composition of a row whose budget is `slots` full-precision slots per page
    (per head: the rule is the same for every head count). Never below `min_slots` tokens."""
    if fmt is None:
        return RowTiers(slots)
    budget = tier_bytes(RowTiers(slots), None, 1, head_dim, dtype_bytes)

    def cost(hi: int, lo: int) -> int:
        return tier_bytes(RowTiers(hi, lo), fmt, 1, head_dim, dtype_bytes)

    if cost(0, page_size) <= budget:
        # 1. Every token kept: upgrade the best ones while the bytes allow.
        hi = max(u for u in range(page_size + 1) if cost(u, page_size - u) <= budget)
        return RowTiers(hi, page_size - hi)
    # 2. As many low-precision tokens as fit, the rest dropped.
    lo = max((n for n in range(page_size + 1) if cost(0, n) <= budget), default=0)
    if lo < max(min_slots, slots):
        return RowTiers(slots)  # the format does not pay at this budget
    return RowTiers(0, lo)
