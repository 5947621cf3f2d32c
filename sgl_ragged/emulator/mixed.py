"""Row tiers with both tiers quantized (e.g. int8 over int4), offline only.

The server stores a row's hi tier at the model dtype (mem_pool/tiers.py); the emulator
(compressed.py, ``TierSelection.hi_fmt``) and bench.accuracy / bench.offline_loss also model a
quantized hi tier, composed here from the same byte budget as ``tiers.compose``.
"""

from __future__ import annotations

from sgl_ragged.mem_pool.tiers import RowTiers, tier_bytes
from sgl_ragged.precision import LowPrecision


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
    within the budget (hi_fmt must cost at least lo_fmt per token). Raises if fewer than
    `min_slots` tokens fit (the sinks): such a budget needs a model-dtype high tier."""
    if any(hi_fmt.tier_bytes(n, 1, head_dim) < lo_fmt.tier_bytes(n, 1, head_dim)
           for n in range(1, page_size + 1)):
        raise ValueError(f"the high tier's format {hi_fmt.name} is cheaper than the low tier's "
                         f"{lo_fmt.name}; put the costlier format in the high tier")
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
