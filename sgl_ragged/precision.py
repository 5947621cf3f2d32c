"""The precision vocabulary: `--ragged-precision` names and the tier formats they pick.

A name is `L` (the page's best tokens at the model dtype, the next ones in format L; `bf16+L` is
the same), `H+L` (the best tokens in format H, the next ones in L: a quantized high tier), or
`bf16` (no low tier, budgets drop tokens), or `mixed` (each head group's low tier in its own
format, as a profile's per-head precisions say: `sgl-ragged profile tiers --precision mixed`).
`TierPrecision` is the parsed pair.

A leaf (docs/architecture.md, "Row tiers"): the server's config and layout, profiles, kernels
and the offline emulator all name precisions; quantization itself lives in mem_pool/quant.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowPrecision:
    """One low-precision format: its name, code bits and whether it stores zero points."""

    name: str
    bits: int
    is_float: bool = False  # fp8: symmetric, scale only

    @property
    def has_zero(self) -> bool:
        return not self.is_float

    @property
    def params_per_scale(self) -> int:
        """float16 numbers stored per quantization group: scale (and zero)."""
        return 2 if self.has_zero else 1

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of one token's codes for one head (keys or values)."""
        if (head_dim * self.bits) % 8:
            raise ValueError(f"head_dim {head_dim} cannot be packed at {self.bits} bits")
        return head_dim * self.bits // 8

    def token_bytes(self, head_dim: int) -> int:
        """Bytes one more token adds to a tier of one head: K and V codes and the value
        token's parameters (the per-page key channel parameters not counted)."""
        return 2 * self.code_bytes(head_dim) + self.params_per_scale * 2

    def tier_bytes(self, tokens: int, heads: int, head_dim: int) -> int:
        """Bytes of K+V of a low tier of `tokens` tokens for `heads` heads of one page:
        codes, per-channel key parameters (once per page, if the tier is not empty) and
        per-token value parameters."""
        if tokens == 0:
            return 0
        codes = 2 * tokens * heads * self.code_bytes(head_dim)
        key_params = heads * head_dim * self.params_per_scale * 2
        value_params = tokens * heads * self.params_per_scale * 2
        return codes + key_params + value_params


LOW_PRECISIONS: dict[str, LowPrecision] = {
    p.name: p
    for p in (
        LowPrecision("int8", 8),
        LowPrecision("int4", 4),
        LowPrecision("int2", 2),
        LowPrecision("fp8", 8, is_float=True),
    )
}
FULL_PRECISION = "bf16"  # --ragged-precision's name for "no low tier" (the model dtype)
PRECISION_CHOICES = (FULL_PRECISION, *LOW_PRECISIONS)
MIXED_PRECISION = "mixed"  # --ragged-precision's name for the profile's per-head low formats


def low_precision(name: str) -> LowPrecision | None:
    """The low tier's format for a --ragged-precision value (None for bf16: drop only)."""
    if name == FULL_PRECISION:
        return None
    if name not in LOW_PRECISIONS:
        raise ValueError(
            f"--ragged-precision {name!r} is unknown; choose one of {list(PRECISION_CHOICES)}, "
            f"{MIXED_PRECISION} (a profile's per-head formats) or a pair <high>{TIER_SEP}<low>"
        )
    if LOW_PRECISIONS[name].is_float and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"--ragged-precision {name}: this torch has no float8_e4m3fn dtype")
    return LOW_PRECISIONS[name]


TIER_SEP = "+"  # "int8+int4": the high tier's format + the low tier's
HIGH_CHOICES = (FULL_PRECISION, "int8", "fp8")  # formats a high tier may take


@dataclass(frozen=True)
class TierPrecision:
    """A parsed --ragged-precision: the high tier's format (None: the model dtype) and the low
    tier's (None: no low tier, the bf16 drop-only layout)."""

    high: LowPrecision | None
    low: LowPrecision | None
    per_head: bool = False  # `mixed`: each group's low format from the profile (high, low None)

    @property
    def name(self) -> str:
        """The canonical name: bf16, L (a model-dtype high tier), H+L or mixed."""
        if self.per_head:
            return MIXED_PRECISION
        if self.low is None:
            return FULL_PRECISION
        return self.low.name if self.high is None else f"{self.high.name}{TIER_SEP}{self.low.name}"


def tier_precision(name: str) -> TierPrecision:
    """Parse a --ragged-precision value (`bf16`, `L`, `bf16+L`, `mixed` or `H+L`, H in HIGH_CHOICES,
    L in LOW_PRECISIONS); raises ValueError saying what is wrong. H must cost at least L per
    token (more code bits, or as many with as many parameters), as tiers.compose_mixed needs."""
    if name == MIXED_PRECISION:
        return TierPrecision(None, None, per_head=True)
    if TIER_SEP not in name:
        return TierPrecision(None, low_precision(name))
    parts = name.split(TIER_SEP)
    if len(parts) != 2 or parts[0] not in HIGH_CHOICES or parts[1] not in LOW_PRECISIONS:
        raise ValueError(
            f"--ragged-precision {name!r} is unknown; a pair is <high>{TIER_SEP}<low> with high "
            f"one of {list(HIGH_CHOICES)} and low one of {list(LOW_PRECISIONS)}, e.g. "
            f"int8{TIER_SEP}int4 (or a single name: {list(PRECISION_CHOICES)})")
    low = low_precision(parts[1])
    if parts[0] == FULL_PRECISION:
        return TierPrecision(None, low)
    high = low_precision(parts[0])
    if (high.bits, high.params_per_scale) < (low.bits, low.params_per_scale):
        raise ValueError(
            f"--ragged-precision {name}: the high tier's format {high.name} costs less per token "
            f"than the low tier's {low.name}; put the costlier format first (e.g. "
            f"{low.name}{TIER_SEP}{high.name})")
    return TierPrecision(high, low)


PAIR_CHOICES = tuple(f"{h}{TIER_SEP}{lo}" for h in HIGH_CHOICES[1:] for lo in LOW_PRECISIONS
                     if (LOW_PRECISIONS[h].bits, LOW_PRECISIONS[h].params_per_scale)
                     >= (LOW_PRECISIONS[lo].bits, LOW_PRECISIONS[lo].params_per_scale))
"""Every H+L pair --ragged-precision accepts (tier_precision), e.g. int8+int4."""
