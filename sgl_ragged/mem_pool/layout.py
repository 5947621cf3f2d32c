"""The ragged layout: how many row slots each (layer, head group) keeps of a logical page.

docs/architecture.md, "The idea in one table". A logical page of P tokens lives at row p of every group's tensor
`[num_pages, k[l][g], H_p, head_dim]`; `k[l][g] = ceil(max_{h in g} B[l,h] * P)` clamped to
[SINK_TOKENS, P]. With a low precision (docs/architecture.md, "Row tiers") the same bytes are spent on tiers
instead (tiers.py): `hi[l][g]` slots at the model dtype, then `lo[l][g]` quantized ones
(quant.py); with `--ragged-precision H+L` the hi slots are quantized too, in format H
(`high`, tiers.compose_mixed); with `--ragged-precision mixed` each group's lo slots have their
own format (`low_formats`, from the profile's per-head precisions). The bytes of one logical page are therefore fixed by the profile and the precision,
which is what lets admission reserve exactly the post-compression footprint (Budget
Reservation).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_ragged.mem_pool.staging_stats import StagingStats
from sgl_ragged.mem_pool.tiers import RowTiers, compose, compose_mixed, tier_bytes
from sgl_ragged.precision import (
    FULL_PRECISION,
    LOW_PRECISIONS,
    MIXED_PRECISION,
    TIER_SEP,
    LowPrecision,
    tier_precision,
)
from sgl_ragged.profile import BudgetProfile
from sgl_ragged.scoring import SINK_TOKENS


@dataclass(frozen=True)
class RaggedLayout:
    """Static shape of the ragged KV storage for one model and profile."""

    page_size: int
    head_dim: int
    dtype_bytes: int
    groups: tuple[tuple[tuple[int, ...], ...], ...]  # [L][G] -> KV-head indices of the group
    slots: tuple[tuple[int, ...], ...]  # [L][G] -> k, kept row slots per logical page (hi + lo)
    tiers: tuple[tuple[RowTiers, ...], ...] | None = None  # [L][G]; None: all slots full precision
    low: LowPrecision | None = None  # format of the lo slots (with low_formats: the commonest)
    high: LowPrecision | None = None  # format of the hi slots (None: the model dtype)
    # [L][G] format of each group's lo slots (None where lo is 0); None: every group's is `low`.
    # Set only when groups differ (`mixed`); a quantized high tier is not combined with it.
    low_formats: tuple[tuple[LowPrecision | None, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.tiers is None:
            object.__setattr__(self, "tiers", tuple(tuple(RowTiers(k) for k in layer)
                                                    for layer in self.slots))
        totals = tuple(tuple(t.total for t in layer) for layer in self.tiers)
        if totals != tuple(map(tuple, self.slots)):
            raise ValueError(f"row tiers {self.tiers} do not add up to the slots {self.slots}")
        if self.low is None and any(t.lo for layer in self.tiers for t in layer):
            raise ValueError("a layout with low-precision slots needs their format")
        if self.high is not None and self.low is None:
            raise ValueError("a layout with a quantized high tier names its low tier's format too")
        if self.low_formats is not None:
            self._check_low_formats()

    def _check_low_formats(self) -> None:
        if self.high is not None:
            raise ValueError(f"per-group low formats (--ragged-precision {MIXED_PRECISION}) take a "
                             "model-dtype high tier; a quantized high tier (H+L) is not combined "
                             "with them")
        shape = tuple(len(layer) for layer in self.low_formats)
        if shape != tuple(len(layer) for layer in self.tiers):
            raise ValueError(f"low_formats has {shape} groups per layer, the tiers "
                             f"{tuple(len(layer) for layer in self.tiers)}")
        for li, (fmts, tiers) in enumerate(zip(self.low_formats, self.tiers, strict=True)):
            for g, (fmt, t) in enumerate(zip(fmts, tiers, strict=True)):
                if t.lo and fmt is None:
                    raise ValueError(f"group {g} of layer {li} keeps {t.lo} low slots without a "
                                     "format")

    def low_format(self, layer: int, group: int) -> LowPrecision | None:
        """The format of one group's lo slots (`low` unless the groups have their own)."""
        if self.low_formats is None:
            return self.low
        return self.low_formats[layer][group]

    @property
    def mixed_formats(self) -> bool:
        """Groups store their low tiers in different formats (--ragged-precision mixed)."""
        return self.low_formats is not None

    @classmethod
    def from_profile(
        cls, profile: BudgetProfile, page_size: int, head_dim: int, dtype_bytes: int,
        precision: str = FULL_PRECISION,
    ) -> RaggedLayout:
        if page_size < SINK_TOKENS:
            raise ValueError(
                f"--page-size {page_size} is too small for the ragged backend: a page must hold "
                f"the {SINK_TOKENS} sink tokens; use --page-size 64 (the default) or any >= {SINK_TOKENS}"
            )
        parsed = tier_precision(precision)
        _check_profile_precision(profile, parsed.name)
        if parsed.per_head:
            return cls._per_head(profile, page_size, head_dim, dtype_bytes)
        fmt, high = parsed.low, parsed.high
        if (fmt is not None and profile.tiers is not None
                and profile.tiers.precision == parsed.name):
            tiers = profile_tiers(profile, page_size)
        else:  # drop only, or the default composition of each group's byte budget
            budget_slots = profile.slots_per_group(page_size, min_slots=SINK_TOKENS)
            tiers = tuple(tuple(_compose(k, page_size, head_dim, dtype_bytes, fmt, high)
                                for k in layer) for layer in budget_slots)
        return cls(
            page_size=page_size,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
            groups=profile.groups,
            slots=tuple(tuple(t.total for t in layer) for layer in tiers),
            tiers=tiers,
            low=fmt if high is not None or any(t.lo for layer in tiers for t in layer) else None,
            high=high,
        )

    @classmethod
    def _per_head(cls, profile: BudgetProfile, page_size: int, head_dim: int,
                  dtype_bytes: int) -> RaggedLayout:
        """The layout of a profile's per-head precisions (--ragged-precision mixed)."""
        tiers = profile_tiers(profile, page_size)
        formats = tuple(tuple(LOW_PRECISIONS[profile.tiers.formats[li][heads[0]]] if t.lo else None
                              for heads, t in zip(layer_groups, layer_tiers, strict=True))
                        for li, (layer_groups, layer_tiers)
                        in enumerate(zip(profile.groups, tiers, strict=True)))
        for li, layer in enumerate(formats):
            for g, fmt in enumerate(layer):
                if fmt is not None and (head_dim * fmt.bits) % 8:
                    raise ValueError(
                        f"the profile's per-head precision {fmt.name} at layer {li}, group "
                        f"{list(profile.groups[li][g])} packs {8 // fmt.bits} channels per byte, "
                        f"but head_dim {head_dim} is not a multiple of {8 // fmt.bits}; re-run "
                        "`sgl-ragged profile tiers --precision mixed --formats int8 fp8`")
        used = [f for layer in formats for f in layer if f is not None]
        low = max(used, key=used.count) if used else None
        return cls(page_size=page_size, head_dim=head_dim, dtype_bytes=dtype_bytes,
                   groups=profile.groups, slots=tuple(tuple(t.total for t in layer) for layer in tiers),
                   tiers=tiers, low=low, low_formats=formats if len(set(used)) > 1 else None)

    @property
    def num_layers(self) -> int:
        return len(self.groups)

    @property
    def num_kv_heads(self) -> int:
        return sum(len(g) for g in self.groups[0])

    @property
    def row_bytes_per_page(self) -> int:
        """Bytes of K+V rows one logical page occupies across all layers and groups."""
        return sum(self.group_bytes(li, g) for li, layer in enumerate(self.tiers)
                   for g in range(len(layer)))

    def group_bytes(self, layer: int, group: int) -> int:
        """Bytes of K+V one page's row takes in one group (its tiers in their formats)."""
        return tier_bytes(self.tiers[layer][group], self.low_format(layer, group),
                          len(self.groups[layer][group]), self.head_dim, self.dtype_bytes, self.high)

    @property
    def quantized(self) -> bool:
        """Some group keeps quantized slots (a low tier, or a quantized high tier)."""
        return self.low is not None or self.high is not None

    @property
    def precision_name(self) -> str:
        """The --ragged-precision these rows are stored in: bf16, L, H+L or mixed."""
        if self.low_formats is not None:
            return MIXED_PRECISION
        if self.high is not None:
            return f"{self.high.name}{TIER_SEP}{self.low.name}"
        return self.low.name if self.low else FULL_PRECISION

    def describe_tiers(self) -> str:
        """One line for logs: the formats and the mean slots per page of each tier."""
        if not self.quantized:
            return "full precision"
        flat = [t for layer in self.tiers for t in layer]
        hi = sum(t.hi for t in flat) / len(flat)
        lo = sum(t.lo for t in flat) / len(flat)
        hi_name = "full" if self.high is None else self.high.name
        lo_name = "low" if self.low is None else self.low.name
        if self.low_formats is not None:
            used = [f.name for layer in self.low_formats for f in layer if f is not None]
            lo_name = "low (" + ", ".join(f"{used.count(n)} groups {n}" for n in sorted(set(used))) + ")"
        return (f"{self.precision_name}: {hi:.1f} {hi_name} + {lo:.1f} {lo_name} slots per page "
                "(mean)")

    @property
    def full_bytes_per_page(self) -> int:
        """Bytes the same page takes in SGLang's uncompressed MHA pool."""
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim * self.dtype_bytes

    @property
    def retention(self) -> float:
        """Effective fraction of KV entries kept (bytes of rows / bytes of full pages)."""
        return self.row_bytes_per_page / self.full_bytes_per_page

    def staging_bytes_per_page(self) -> int:
        """One staging page: full K+V of all layers plus its score accumulators (StagingStats)."""
        return self.full_bytes_per_page + StagingStats.bytes_per_page(
            self.num_layers, self.num_kv_heads, self.page_size, self.head_dim)

    def num_logical_pages(self, available_bytes: int, num_staging_pages: int) -> int:
        """Logical pages that fit in `available_bytes` once the staging pool (its pages plus
        the scratch page, RaggedStorage.scratch_stage) is taken out."""
        rest = available_bytes - (num_staging_pages + 1) * self.staging_bytes_per_page()
        return max(rest, 0) // self.row_bytes_per_page


def _compose(slots: int, page_size: int, head_dim: int, dtype_bytes: int,
             fmt: LowPrecision | None, high: LowPrecision | None) -> RowTiers:
    """One group's default composition: tiers.compose, or compose_mixed with a quantized
    high tier."""
    if high is None:
        return compose(slots, page_size, head_dim, dtype_bytes, fmt, SINK_TOKENS)
    return compose_mixed(slots, page_size, head_dim, dtype_bytes, high, fmt, SINK_TOKENS)


def _check_profile_precision(profile: BudgetProfile, precision: str) -> None:
    """--ragged-precision mixed serves exactly the profiles with per-head precisions, and those
    are served by nothing else (a clear error instead of a silent other layout)."""
    per_head = profile.tiers is not None and profile.tiers.per_head
    if precision == MIXED_PRECISION and not per_head:
        raise ValueError(f"--ragged-precision {MIXED_PRECISION} serves a profile's per-head "
                         "precisions, but this profile has none; write one with `sgl-ragged "
                         f"profile tiers --precision {MIXED_PRECISION}` or pick one precision "
                         "(e.g. --ragged-precision int4)")
    if per_head and precision != MIXED_PRECISION:
        raise ValueError(f"the profile stores a low precision per head (tiers.precision "
                         f"{MIXED_PRECISION}); serve it with --ragged-precision {MIXED_PRECISION}, "
                         f"not {precision}")


def profile_tiers(profile: BudgetProfile, page_size: int) -> tuple[tuple[RowTiers, ...], ...]:
    """[L][G] row tiers a profile's compositions give at this page size (every head of a group
    has its group's shares)."""
    out = []
    for li, layer_groups in enumerate(profile.groups):
        row = []
        for heads in layer_groups:
            h = heads[0]
            t = RowTiers(round(profile.tiers.hi[li][h] * page_size), round(profile.tiers.lo[li][h] * page_size))
            if not SINK_TOKENS <= t.total <= page_size:
                raise ValueError(f"the profile's tiers keep {t.total} tokens of a {page_size}-token "
                                 f"page at layer {li}, group {list(heads)}; a row keeps between "
                                 f"{SINK_TOKENS} (the sinks) and the page")
            row.append(t)
        out.append(tuple(row))
    return tuple(out)

