"""The budget profile: static per-(layer, KV head) budgets and head groups (docs/calibration.md).

A profile is calibrated offline once per model (TANGRAM section 4.1) and loaded by
the server, which sizes every group's ragged rows from it. On disk it is a
versioned, self-describing JSON file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import sgl_ragged.budgets as budget_math
from sgl_ragged.profile.model_shape import ModelShape
from sgl_ragged.profile.samples import SampleRetention
from sgl_ragged.profile.source import MODEL_FREE_KINDS, SourceRecord
from sgl_ragged.profile.tiers import ProfileTiers
from sgl_ragged.profile.validation import (
    PER_HEAD_VERSION,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    TIERS_VERSION,
    ProfileError,
    as_lists,
    check_budget_range,
    check_groups,
    check_header,
    check_heads_per_group,
    check_jsonable,
    check_shape,
    checked_split_ratios,
    float_matrix,
    stat_matrix,
)

CALIBRATE_HINT = (
    "calibrate one for this model with `python -m sgl_ragged.calibrate --model ...` "
    "or use `uniform:<ratio>`"
)

PathLike = str | os.PathLike

# A JSON array of numbers spread over lines by json.dumps(indent=...): "[\n  1,\n  2\n]".
_NUMBER_LIST = re.compile(r"\[\n[-+0-9.eE,\s]*\]")


@dataclass(frozen=True)
class BudgetProfile:
    """Static retention budgets B[l][h] and head groups of one model (TANGRAM sections 4.1, 4.2).

    Nested sequences are stored as tuples; lists are accepted and converted, and so is a
    JSON object (dict) for ``source``.
    """

    model: ModelShape | None  # None only for model-free sources (SourceRecord.fits_any_model)
    budgets: tuple[tuple[float, ...], ...]  # [L][H] retention budget in (0, 1]
    groups: tuple[tuple[tuple[int, ...], ...], ...]  # [L][G][H_p] KV-head indices
    source: SourceRecord  # kind, scorer, scorer params, rho, alpha, ... (a dict is converted)
    mu: tuple[tuple[float, ...], ...] | None = None  # [L][H] mean retention over samples
    sigma: tuple[tuple[float, ...], ...] | None = None  # [L][H] its standard deviation
    split_ratios: tuple[tuple[float, ...], ...] | None = None  # [L][G] Phi / Omega
    stats: dict[str, Any] = field(default_factory=dict)  # summary statistics
    tiers: ProfileTiers | None = None  # row compositions for a low precision (version 2)

    def __post_init__(self) -> None:
        budgets = float_matrix("budgets", self.budgets)
        object.__setattr__(self, "budgets", budgets)
        if not budgets:
            raise ProfileError("budgets must have at least one layer")
        num_heads = len(budgets[0])
        check_shape("budgets", budgets, len(budgets), num_heads)
        check_budget_range(budgets)
        object.__setattr__(self, "groups", check_groups(self.groups, len(budgets), num_heads))
        for name in ("mu", "sigma"):
            object.__setattr__(self, name, stat_matrix(name, getattr(self, name), len(budgets), num_heads))
        ratios = checked_split_ratios(self.split_ratios, budgets, self.groups, self.num_groups)
        object.__setattr__(self, "split_ratios", ratios)
        if self.tiers is not None:
            object.__setattr__(self, "tiers", self.tiers.check(len(budgets), self.groups))
        self._check_source_and_model()

    # ----- derived values -----------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.budgets)

    @property
    def num_kv_heads(self) -> int:
        return len(self.budgets[0])

    @property
    def heads_per_group(self) -> int:
        return len(self.groups[0][0])

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.heads_per_group

    @property
    def mean_budget(self) -> float:
        """Mean of B over all (layer, head): the retention the budgets promise on average."""
        return math.fsum(b for layer in self.budgets for b in layer) / (
            self.num_layers * self.num_kv_heads
        )

    @property
    def sample_retention(self) -> SampleRetention | None:
        """The per-sample retention calibration recorded, if the profile carries it."""
        data = self.stats.get("samples")
        if data is None:
            return None
        return SampleRetention.from_stats(data, self.num_layers, self.num_kv_heads)

    @property
    def group_budgets(self) -> tuple[tuple[float, ...], ...]:
        """[L][G] budget of each group: the largest budget among its heads."""
        return budget_math.group_budgets(self.budgets, self.groups)

    # ----- use ----------------------------------------------------------------------

    def check_model(self, shape: ModelShape) -> None:
        """Raise ProfileError listing every difference if this profile does not fit ``shape``."""
        if self.model is not None:
            diffs = self.model.differences(shape)
            calibrated_for = f"this profile was calibrated for {self.model.describe()}"
        else:
            mine = (("num_layers", self.num_layers), ("num_kv_heads", self.num_kv_heads))
            diffs = [
                f"{name}: profile has {value}, model has {getattr(shape, name)}"
                for name, value in mine
                if value != getattr(shape, name)
            ]
            calibrated_for = (
                f"this profile has {self.num_layers} layers and {self.num_kv_heads} KV heads"
            )
        if diffs:
            lines = "\n".join(f"  {d}" for d in diffs)
            raise ProfileError(
                f"budget profile does not fit the model {shape.describe()}:\n{lines}\n"
                f"{calibrated_for}; {CALIBRATE_HINT}"
            )

    def slots_per_group(self, page_size: int, min_slots: int = 4) -> tuple[tuple[int, ...], ...]:
        """[L][G] row slots per logical page: clamp(ceil(max_{h in g} B[l,h] * P), min_slots, P).

        ``min_slots`` defaults to the 4 sink tokens: the first page of a sequence must
        always be able to keep them, however small the group's budget.
        """
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ProfileError(f"page_size must be a positive int, got {page_size!r}")
        if not 1 <= min_slots <= page_size:
            raise ProfileError(
                f"page_size={page_size} is smaller than min_slots={min_slots}: the first page "
                f"must keep {min_slots} sink tokens; use a page size of at least {min_slots}"
            )
        return budget_math.group_slots(self.budgets, self.groups, page_size, min_slots)

    def split_map(self, num_ctas: int) -> tuple[tuple[int, ...], ...]:
        """[L][G] static workload split map for a device with ``num_ctas`` CTAs (Algorithm 1)."""
        return budget_math.split_map(self.budgets, self.groups, num_ctas)

    def regrouped(self, heads_per_group: int, clustered: bool = True) -> BudgetProfile:
        """The same budgets in groups of ``heads_per_group`` heads (clustered or adjacent).

        A profile carrying row tiers is searched for its own groups (each group's composition,
        and with per-head precision each head's format): regrouping would lose them, so it is
        refused unless the grouping stays the same."""
        check_heads_per_group(self.num_kv_heads, heads_per_group)
        if self.tiers is not None:
            if heads_per_group == self.heads_per_group:
                return self
            search = (f"`sgl-ragged profile tiers ... --precision mixed --heads-per-group "
                      f"{heads_per_group}`" if self.tiers.per_head else
                      f"`sgl-ragged profile tiers` on a profile in groups of {heads_per_group}")
            raise ProfileError(
                f"this profile carries row tiers searched for head groups of {self.heads_per_group} "
                f"(tiers {self.tiers.precision!r}), and regrouping to {heads_per_group} heads per "
                f"group would lose them: leave --ragged-heads-per-group unset, or search tiers for "
                f"that grouping ({search})")
        if clustered:
            groups = tuple(
                budget_math.cluster_heads(layer, heads_per_group) for layer in self.budgets
            )
        else:
            adjacent = budget_math.adjacent_groups(self.num_kv_heads, heads_per_group)
            groups = tuple(adjacent for _ in self.budgets)
        ratios = (
            budget_math.split_ratios(self.budgets, groups)
            if self.split_ratios is not None
            else None
        )
        return BudgetProfile(
            self.model, self.budgets, groups, self.source, self.mu, self.sigma,
            ratios, dict(self.stats),
        )  # fmt: skip

    # ----- serialisation ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with the format marker and version."""
        return {
            "format": PROFILE_FORMAT,
            "version": self._version(),
            "model": None if self.model is None else self.model.to_dict(),
            "source": self.source.to_json(),
            "budgets": as_lists(self.budgets),
            "groups": as_lists(self.groups),
            "mu": as_lists(self.mu),
            "sigma": as_lists(self.sigma),
            "split_ratios": as_lists(self.split_ratios),
            "stats": self.stats,
            **({} if self.tiers is None else {"tiers": self.tiers.to_dict()}),
        }

    def _version(self) -> int:
        """The oldest format version that holds this profile (old files re-save byte-identically)."""
        if self.tiers is None or not (self.tiers.per_head or self.tiers.rotated):
            return TIERS_VERSION
        return PROFILE_VERSION if self.tiers.rotated else PER_HEAD_VERSION

    @classmethod
    def from_dict(cls, data: Any) -> BudgetProfile:
        """Inverse of ``to_dict``; raises ProfileError naming the problem."""
        if not isinstance(data, dict):
            raise ProfileError(f"a profile must be a JSON object, got {type(data).__name__}")
        check_header(data)
        model = None if data["model"] is None else ModelShape.from_dict(data["model"])
        tiers = (None if data.get("tiers") is None
                 else ProfileTiers.from_dict(data["tiers"], data["version"]))
        return cls(
            model, data["budgets"], data["groups"], data["source"], data.get("mu"),
            data.get("sigma"), data.get("split_ratios"), data.get("stats", {}), tiers,
        )  # fmt: skip

    def save(self, path: PathLike) -> None:
        """Write the profile as pretty JSON (innermost number lists on one line)."""
        text = json.dumps(self.to_dict(), indent=2)
        text = _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(0)[1:-1].split()) + "]", text)
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: PathLike) -> BudgetProfile:
        """Read a profile file; every problem is a ProfileError naming the file."""
        name = os.fspath(path)
        if not os.path.isfile(name):
            what = "is a directory" if os.path.isdir(name) else "does not exist"
            raise ProfileError(
                f"profile file {name!r} {what}; pass a file written by "
                f"`python -m sgl_ragged.calibrate` or `uniform:<ratio>`"
            )
        try:
            with open(name, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"profile file {name!r} is not valid JSON: {exc}") from exc
        except OSError as exc:
            raise ProfileError(f"cannot read profile file {name!r}: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"profile file {name!r}: {exc}") from exc

    # ----- validation helpers -------------------------------------------------------

    def _check_source_and_model(self) -> None:
        object.__setattr__(self, "source", SourceRecord.of(self.source))
        check_jsonable("source", self.source.to_json())
        check_jsonable("stats", self.stats)
        if not isinstance(self.stats, dict):
            raise ProfileError(f"stats must be an object, got {self.stats!r:.80}")
        self.sample_retention  # noqa: B018 -- validates stats["samples"] when present
        if self.model is None:
            if not self.source.fits_any_model:
                raise ProfileError(
                    f"a {self.source.kind!r} profile must record the model it was calibrated for "
                    f"(model is null); only {sorted(MODEL_FREE_KINDS)} profiles fit any model"
                )
            return
        if not isinstance(self.model, ModelShape):
            raise ProfileError(f"model must be a ModelShape or None, got {self.model!r}")
        model_shape = (self.model.num_layers, self.model.num_kv_heads)
        if model_shape != (self.num_layers, self.num_kv_heads):
            raise ProfileError(
                f"the profile's model has {model_shape[0]} layers and {model_shape[1]} KV heads "
                f"but its budgets are [{self.num_layers}][{self.num_kv_heads}]; the profile is "
                f"inconsistent, re-run calibration"
            )
