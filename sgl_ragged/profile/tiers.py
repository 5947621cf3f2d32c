"""Row compositions a profile may carry for one low precision (format version 2), or with a
low precision per (layer, KV head) (`precision` "mixed", `formats`: format version 3), searched
for rows stored rotated (`rotation` "hadamard": format version 4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sgl_ragged.precision import LOW_PRECISIONS, MIXED_PRECISION
from sgl_ragged.profile.validation import ProfileError, as_lists, check_shape, float_matrix
from sgl_ragged.rotation import ROTATIONS

NO_ROTATION = ROTATIONS[0]  # "none": rows stored as computed


@dataclass(frozen=True)
class ProfileTiers:
    """Row compositions for one low precision (docs/architecture.md, "Row tiers"), per (layer, KV head):
    the shares of a page's tokens kept at the model dtype (hi) and at `precision` (lo). Heads
    of a group share their group's composition. Used when the server runs with
    `--ragged-precision <precision>`; other precisions use the default rule (mem_pool/tiers.py).

    With `precision` "mixed" every head's low tier has its own format, `formats[l][h]` (a name
    in LOW_PRECISIONS; heads of a group share it), served by `--ragged-precision mixed` only.

    With `rotation` "hadamard" the compositions (and formats) were searched on rows stored
    rotated (`sgl-ragged profile tiers --rotation hadamard`; rotation.py): the server stores
    them so (`--ragged-rotation auto` reads it) and refuses to serve them unrotated at this
    precision.
    """

    precision: str
    hi: tuple[tuple[float, ...], ...]  # [L][H] in [0, 1]
    lo: tuple[tuple[float, ...], ...]  # [L][H] in [0, 1], hi + lo <= 1
    formats: tuple[tuple[str, ...], ...] | None = None  # [L][H] low format names ("mixed" only)
    rotation: str = NO_ROTATION  # rotation.ROTATIONS: how the rows were stored when searched

    @property
    def rotated(self) -> bool:
        return self.rotation != NO_ROTATION

    @property
    def per_head(self) -> bool:
        """Each head's low tier has its own format (`formats`)."""
        return self.formats is not None

    def check(self, num_layers: int, groups: Sequence[Sequence[Sequence[int]]]) -> ProfileTiers:
        formats = self._check_precision(num_layers, groups)
        if self.rotation not in ROTATIONS:
            raise ProfileError(f"tiers.rotation {self.rotation!r} is not one of {list(ROTATIONS)}")
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
                fmts = {formats[li][h] for h in group} if formats else set()
                if len({(hi[li][h], lo[li][h]) for h in group}) > 1 or len(fmts) > 1:
                    raise ProfileError(f"tiers at layer {li}: the heads of group {list(group)} "
                                       "have different compositions; a group shares one row")
        return ProfileTiers(self.precision, hi, lo, formats, self.rotation)

    def _check_precision(self, num_layers: int, groups: Sequence[Sequence[Sequence[int]]],
                         ) -> tuple[tuple[str, ...], ...] | None:
        """The checked per-head formats (None for one precision)."""
        if self.precision == MIXED_PRECISION:
            if self.formats is None:
                raise ProfileError(f"tiers.precision {MIXED_PRECISION!r} needs tiers.formats, "
                                   "the low precision of every (layer, KV head)")
            num_heads = sum(len(g) for g in groups[0])
            if not isinstance(self.formats, list | tuple) or not all(
                    isinstance(row, list | tuple) for row in self.formats):
                raise ProfileError(f"tiers.formats must be a list of lists of format names, got "
                                   f"{self.formats!r:.80}")
            check_shape("tiers.formats", self.formats, num_layers, num_heads)
            for li, row in enumerate(self.formats):
                for h, name in enumerate(row):
                    if name not in LOW_PRECISIONS:
                        raise ProfileError(
                            f"tiers.formats[{li}][{h}] = {name!r} is not a low precision this "
                            f"sgl-ragged serves; use one of {sorted(LOW_PRECISIONS)} (re-run "
                            "`sgl-ragged profile tiers --precision mixed`)")
            return tuple(tuple(row) for row in self.formats)
        if self.precision not in LOW_PRECISIONS:
            raise ProfileError(f"tiers.precision {self.precision!r} is not one of "
                               f"{sorted(LOW_PRECISIONS)} or {MIXED_PRECISION!r}")
        if self.formats is not None:
            raise ProfileError(f"tiers.formats is only read with tiers.precision "
                               f"{MIXED_PRECISION!r}, not {self.precision!r}")
        return None

    def to_dict(self) -> dict[str, Any]:
        extra = {} if self.formats is None else {"formats": as_lists(self.formats)}
        if self.rotated:
            extra["rotation"] = self.rotation
        return {"precision": self.precision, "hi": as_lists(self.hi), "lo": as_lists(self.lo),
                **extra}

    @classmethod
    def from_dict(cls, data: Any, version: int = 4) -> ProfileTiers:
        keys = {"precision", "hi", "lo"}
        if version >= 3 and isinstance(data, dict) and "formats" in data:
            keys |= {"formats"}
        if version >= 4 and isinstance(data, dict) and "rotation" in data:
            keys |= {"rotation"}
        if not isinstance(data, dict) or set(data) != keys:
            raise ProfileError("tiers must be an object with keys precision, hi and lo (and, from "
                               "format version 3, formats; from version 4, rotation)")
        return cls(data["precision"], data["hi"], data["lo"], data.get("formats"),
                   data.get("rotation", NO_ROTATION))
