"""The precision vocabulary: `--ragged-precision` names and the low-tier formats they pick.

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


def low_precision(name: str) -> LowPrecision | None:
    """The low tier's format for a --ragged-precision value (None for bf16: drop only)."""
    if name == FULL_PRECISION:
        return None
    if name not in LOW_PRECISIONS:
        raise ValueError(
            f"--ragged-precision {name!r} is unknown; choose one of {list(PRECISION_CHOICES)}"
        )
    if LOW_PRECISIONS[name].is_float and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"--ragged-precision {name}: this torch has no float8_e4m3fn dtype")
    return LOW_PRECISIONS[name]
