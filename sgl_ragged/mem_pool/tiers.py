"""How a group's byte budget per page is spent: tokens at the model dtype, tokens at a low
precision, the rest dropped (docs/architecture.md, "Row tiers").

The budget of a group is what `k` full-precision slots cost (k = clamp(ceil(B * P), sinks, P),
the drop-only layout's slots), so a precision never costs more bytes than dropping alone.

The default rule (`compose`), from the offline frontier (docs/results.md, "Precision before
dropping"): keeping every token at the low precision beats dropping at equal bytes by ~20x in
KL, and upgrading the page's best tokens to full precision with what is left helps further; so

1. if all P tokens fit at the low precision, keep them all, then upgrade the best ones (by the
   scorer, sinks first) to the model dtype while the bytes allow;
2. else keep as many tokens as fit at the low precision (the best ones) and drop the rest:
   below what the low tier of a whole page costs, dropping on top of it beats a coarser format.

With a quantized high tier (`--ragged-precision H+L`, `compose_mixed`): the most tokens that fit
at L, then the best of them upgraded to H while the bytes allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_ragged.precision import LowPrecision


@dataclass(frozen=True)
class RowTiers:
    """Slots per page of one group's row: `hi` at the model dtype (or the high tier's format),
    then `lo` quantized."""

    hi: int
    lo: int = 0

    @property
    def total(self) -> int:
        return self.hi + self.lo


def tier_bytes(tiers: RowTiers, fmt: LowPrecision | None, heads: int, head_dim: int,
               dtype_bytes: int, hi_fmt: LowPrecision | None = None) -> int:
    """Bytes of K+V one page's row takes in one group of `heads` heads (its hi slots at the
    model dtype, or quantized in `hi_fmt`: mixed_tier_bytes)."""
    if hi_fmt is not None:
        if tiers.lo and fmt is None:
            raise ValueError("a row with a low tier needs a low precision")
        lo = fmt.tier_bytes(tiers.lo, heads, head_dim) if tiers.lo else 0
        return hi_fmt.tier_bytes(tiers.hi, heads, head_dim) + lo
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


def mixed_tier_bytes(tiers: RowTiers, hi_fmt: LowPrecision, lo_fmt: LowPrecision, heads: int,
                     head_dim: int) -> int:
    """Bytes of K+V one page's row takes in one group of `heads` heads when its `hi` slots are
    quantized in `hi_fmt` and its `lo` slots in `lo_fmt` (each tier with its own codes, key
    channel parameters and value token parameters, as `LowPrecision.tier_bytes`)."""
    return hi_fmt.tier_bytes(tiers.hi, heads, head_dim) + lo_fmt.tier_bytes(tiers.lo, heads, head_dim)


def compose_mixed(slots: int, page_size: int, head_dim: int, dtype_bytes: int,
                  hi_fmt: LowPrecision, lo_fmt: LowPrecision, min_slots: int) -> RowTiers:
    """`compose` with the high tier at a low precision too (e.g. int8 over int4): the row of a
    budget of `slots` model-dtype slots per page keeps as many tokens as fit at `lo_fmt` (every
    token when a whole page fits), then upgrades the best of them (by the scorer, sinks first)
    to `hi_fmt` while the bytes allow. Equivalently: the most tokens, then the most `hi` ones,
    within the budget (hi_fmt must cost at least lo_fmt per token: `token_bytes`). Raises if
    fewer than `min_slots` tokens fit (the sinks): such a budget needs a model-dtype high tier."""
    if hi_fmt.token_bytes(head_dim) < lo_fmt.token_bytes(head_dim):
        raise ValueError(f"the high tier's format {hi_fmt.name} is cheaper per token than the low "
                         f"tier's {lo_fmt.name}; put the costlier format in the high tier")
    budget = tier_bytes(RowTiers(slots), None, 1, head_dim, dtype_bytes)

    def cost(hi: int, lo: int) -> int:
        return mixed_tier_bytes(RowTiers(hi, lo), hi_fmt, lo_fmt, 1, head_dim)

    # 1. The most tokens that fit, all at the low precision.
    total = max((n for n in range(page_size + 1) if cost(0, n) <= budget), default=0)
    if total < min_slots:
        raise ValueError(f"{slots} slots per page cannot hold {min_slots} tokens at "
                         f"{hi_fmt.name}+{lo_fmt.name}; use a bf16 high tier at this budget")
    # 2. Upgrade the best of them while the bytes allow.
    hi = max(u for u in range(total + 1) if cost(u, total - u) <= budget)
    return RowTiers(hi, total - hi)
