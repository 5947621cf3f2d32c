"""Row compositions a profile may carry for one low precision (format version 2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.profile.validation import ProfileError, as_lists, check_shape, float_matrix


@dataclass(frozen=True)
class ProfileTiers:
    """Row compositions for one low precision (docs/architecture.md, "Row tiers"), per (layer, KV head):
    the shares of a page's tokens kept at the model dtype (hi) and at `precision` (lo). Heads
    of a group share their group's composition. Used when the server runs with
    `--ragged-precision <precision>`; other precisions use the default rule (mem_pool/tiers.py).
    """

    precision: str
    hi: tuple[tuple[float, ...], ...]  # [L][H] in [0, 1]
    lo: tuple[tuple[float, ...], ...]  # [L][H] in [0, 1], hi + lo <= 1

    def check(self, num_layers: int, groups: Sequence[Sequence[Sequence[int]]]) -> ProfileTiers:
        if self.precision not in LOW_PRECISIONS:
            raise ProfileError(f"tiers.precision {self.precision!r} is not one of "
                               f"{sorted(LOW_PRECISIONS)}")
        hi, lo = float_matrix("tiers.hi", self.hi), float_matrix("tiers.lo", self.lo)
        num_heads = sum(len(g) for g in groups[0])
        for name, m in (("tiers.hi", hi), ("tiers.lo", lo)):
            check_shape(name, m, num_layers, num_heads)
        for li, layer_groups in enumerate(groups):
            for h in range(num_heads):
                if not (0.0 <= hi[li][h] and 0.0 <= lo[li][h] and hi[li][h] + lo[li][h] <= 1.0 + 1e-9):
                    raise ProfileError(f"tiers at layer {li} head {h}: hi {hi[li][h]} + lo "
                                       f"{lo[li][h]} must be shares of a page in [0, 1]")
            for group in layer_groups:
                if len({(hi[li][h], lo[li][h]) for h in group}) > 1:
                    raise ProfileError(f"tiers at layer {li}: the heads of group {list(group)} "
                                       "have different compositions; a group shares one row")
        return ProfileTiers(self.precision, hi, lo)

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "hi": as_lists(self.hi), "lo": as_lists(self.lo)}

    @classmethod
    def from_dict(cls, data: Any) -> ProfileTiers:
        if not isinstance(data, dict) or set(data) != {"precision", "hi", "lo"}:
            raise ProfileError("tiers must be an object with keys precision, hi and lo")
        return cls(data["precision"], data["hi"], data["lo"])
