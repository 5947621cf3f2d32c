"""The budget profile: static per-(layer, KV head) budgets and head groups (DESIGN.md section 5).

A profile is calibrated offline once per model (TANGRAM section 4.1) and loaded by
the server, which sizes every group's ragged rows from it. On disk it is a
versioned, self-describing JSON file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import sgl_ragged.budgets as budget_math

PROFILE_FORMAT = "sgl-ragged-profile"
PROFILE_VERSION = 2  # 2: optional "tiers" (row compositions for a low precision)
READABLE_VERSIONS = (1, 2)
# Budget sources whose profiles fit any model and therefore record none.
MODEL_FREE_KINDS = frozenset({"uniform", "dynamic"})
UNIFORM_SPEC_HELP = "expected uniform:<ratio in (0,1]>"
# Schema of the calibrator's entries in the open ``stats`` object (version 1 files carry any
# JSON there; these keys are checked on load when present). stats["samples"] holds the
# per-sample retention the budgets were derived from: {"tasks": [S], "tokens": [S],
# "retention": [S][L][H]}.
STATS_SCHEMA = 1
CALIBRATE_HINT = (
    "calibrate one for this model with `python -m sgl_ragged.calibrate --model ...` "
    "or use `uniform:<ratio>`"
)

PathLike = str | os.PathLike


class ProfileError(ValueError):
    """A budget profile is malformed or does not fit the model; the message says how to fix it."""


@dataclass(frozen=True)
class ModelShape:
    """The model facts a profile depends on (its fingerprint)."""

    architecture: str  # HF config architectures[0], e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ProfileError(
                f"model architecture must be a non-empty string, got {self.architecture!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"model {name} must be a positive int, got {value!r}")

    def differences(self, other: ModelShape) -> list[str]:
        """Lines "field: profile has X, model has Y" (self is the profile's side)."""
        return [
            f"{f.name}: profile has {getattr(self, f.name)}, model has {getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def describe(self) -> str:
        return (
            f"{self.architecture} with {self.num_layers} layers, "
            f"{self.num_kv_heads} KV heads, head_dim {self.head_dim}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> ModelShape:
        if not isinstance(data, dict):
            raise ProfileError(f"'model' must be an object or null, got {data!r}")
        names = [f.name for f in fields(cls)]
        if sorted(data) != sorted(names):
            raise ProfileError(f"'model' must have exactly the keys {names}, got {sorted(data)}")
        return cls(**{name: data[name] for name in names})


@dataclass(frozen=True)
class SampleRetention:
    """Per-sample retention recorded by calibration (``stats["samples"]``)."""

    tasks: tuple[str, ...]  # [S] task type of each sample
    tokens: tuple[int, ...]  # [S] sample length in tokens
    retention: tuple[tuple[tuple[float, ...], ...], ...]  # [S][L][H] kept / offered

    @classmethod
    def from_stats(cls, data: Any, num_layers: int, num_heads: int) -> SampleRetention:
        """Parse and check ``stats["samples"]`` against the profile's [L][H] shape."""
        if not isinstance(data, dict) or sorted(data) != ["retention", "tasks", "tokens"]:
            raise ProfileError(
                "stats.samples must be an object with exactly the keys "
                f"['retention', 'tasks', 'tokens'], got {data!r:.80}"
            )
        tasks, tokens, retention = data["tasks"], data["tokens"], data["retention"]
        if not _is_sequence(retention) or not retention:
            raise ProfileError("stats.samples.retention must be a non-empty list [S][L][H]")
        count = len(retention)
        if not (_is_sequence(tasks) and len(tasks) == count and all(isinstance(t, str) for t in tasks)):
            raise ProfileError(f"stats.samples.tasks must be {count} strings, one per sample")
        if not (_is_sequence(tokens) and len(tokens) == count
                and all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tokens)):  # fmt: skip
            raise ProfileError(f"stats.samples.tokens must be {count} positive ints, one per sample")
        matrices = []
        for i, sample in enumerate(retention):
            name = f"stats.samples.retention[{i}]"
            matrix = _float_matrix(name, sample)
            _check_shape(name, matrix, num_layers, num_heads)
            if any(not 0.0 <= x <= 1.0 for row in matrix for x in row):
                raise ProfileError(f"{name} has a retention outside [0, 1]")
            matrices.append(matrix)
        return cls(tuple(tasks), tuple(tokens), tuple(matrices))


@dataclass(frozen=True)
class ProfileTiers:
    """Row compositions for one low precision (DESIGN.md section 11), per (layer, KV head):
    the shares of a page's tokens kept at the model dtype (hi) and at `precision` (lo). Heads
    of a group share their group's composition. Used when the server runs with
    `--ragged-precision <precision>`; other precisions use the default rule (mem_pool/tiers.py).
    """

    precision: str
    hi: tuple[tuple[float, ...], ...]  # [L][H] in [0, 1]
    lo: tuple[tuple[float, ...], ...]  # [L][H] in [0, 1], hi + lo <= 1

    def check(self, num_layers: int, groups: Sequence[Sequence[Sequence[int]]]) -> ProfileTiers:
        from sgl_ragged.mem_pool.quant import LOW_PRECISIONS

        if self.precision not in LOW_PRECISIONS:
            raise ProfileError(f"tiers.precision {self.precision!r} is not one of "
                               f"{sorted(LOW_PRECISIONS)}")
        hi, lo = _float_matrix("tiers.hi", self.hi), _float_matrix("tiers.lo", self.lo)
        num_heads = sum(len(g) for g in groups[0])
        for name, m in (("tiers.hi", hi), ("tiers.lo", lo)):
            _check_shape(name, m, num_layers, num_heads)
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
        return {"precision": self.precision, "hi": _lists(self.hi), "lo": _lists(self.lo)}

    @classmethod
    def from_dict(cls, data: Any) -> ProfileTiers:
        if not isinstance(data, dict) or set(data) != {"precision", "hi", "lo"}:
            raise ProfileError("tiers must be an object with keys precision, hi and lo")
        return cls(data["precision"], data["hi"], data["lo"])


@dataclass(frozen=True)
class BudgetProfile:
    """Static retention budgets B[l][h] and head groups of one model (TANGRAM sections 4.1, 4.2).

    Nested sequences are stored as tuples; lists are accepted and converted.
    """

    model: ModelShape | None  # None only for sources in MODEL_FREE_KINDS (fit any model)
    budgets: tuple[tuple[float, ...], ...]  # [L][H] retention budget in (0, 1]
    groups: tuple[tuple[tuple[int, ...], ...], ...]  # [L][G][H_p] KV-head indices
    source: dict[str, Any]  # kind, scorer, scorer params, rho, alpha, samples, ...
    mu: tuple[tuple[float, ...], ...] | None = None  # [L][H] mean retention over samples
    sigma: tuple[tuple[float, ...], ...] | None = None  # [L][H] its standard deviation
    split_ratios: tuple[tuple[float, ...], ...] | None = None  # [L][G] Phi / Omega
    stats: dict[str, Any] = field(default_factory=dict)  # summary statistics
    tiers: ProfileTiers | None = None  # row compositions for a low precision (version 2)

    def __post_init__(self) -> None:
        budgets = _float_matrix("budgets", self.budgets)
        object.__setattr__(self, "budgets", budgets)
        if not budgets:
            raise ProfileError("budgets must have at least one layer")
        num_heads = len(budgets[0])
        _check_shape("budgets", budgets, len(budgets), num_heads)
        _check_budget_range(budgets)
        object.__setattr__(self, "groups", _check_groups(self.groups, len(budgets), num_heads))
        for name in ("mu", "sigma"):
            object.__setattr__(self, name, self._stat_matrix(name))
        object.__setattr__(self, "split_ratios", self._checked_split_ratios())
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
        """The same budgets in groups of ``heads_per_group`` heads (clustered or adjacent)."""
        _check_heads_per_group(self.num_kv_heads, heads_per_group)
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
            self.model, self.budgets, groups, dict(self.source), self.mu, self.sigma,
            ratios, dict(self.stats),
        )  # fmt: skip

    # ----- serialisation ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with the format marker and version."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": None if self.model is None else self.model.to_dict(),
            "source": self.source,
            "budgets": _lists(self.budgets),
            "groups": _lists(self.groups),
            "mu": _lists(self.mu),
            "sigma": _lists(self.sigma),
            "split_ratios": _lists(self.split_ratios),
            "stats": self.stats,
            **({} if self.tiers is None else {"tiers": self.tiers.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> BudgetProfile:
        """Inverse of ``to_dict``; raises ProfileError naming the problem."""
        if not isinstance(data, dict):
            raise ProfileError(f"a profile must be a JSON object, got {type(data).__name__}")
        _check_header(data)
        model = None if data["model"] is None else ModelShape.from_dict(data["model"])
        tiers = None if data.get("tiers") is None else ProfileTiers.from_dict(data["tiers"])
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

    def _stat_matrix(self, name: str) -> tuple[tuple[float, ...], ...] | None:
        value = getattr(self, name)
        if value is None:
            return None
        matrix = _float_matrix(name, value)
        _check_shape(name, matrix, self.num_layers, self.num_kv_heads)
        low, high = (0.0, 1.0) if name == "mu" else (0.0, math.inf)
        for li, row in enumerate(matrix):
            for h, x in enumerate(row):
                if not low <= x <= high:
                    raise ProfileError(f"{name}[{li}][{h}] = {x} is outside [{low}, {high}]")
        return matrix

    def _checked_split_ratios(self) -> tuple[tuple[float, ...], ...] | None:
        if self.split_ratios is None:
            return None
        ratios = _float_matrix("split_ratios", self.split_ratios)
        _check_shape("split_ratios", ratios, self.num_layers, self.num_groups)
        expected = budget_math.split_ratios(self.budgets, self.groups)
        for li, (row, want) in enumerate(zip(ratios, expected, strict=True)):
            if any(not math.isclose(x, y, abs_tol=1e-6) for x, y in zip(row, want, strict=True)):
                raise ProfileError(
                    f"split_ratios[{li}] = {list(row)} does not match the budgets and groups "
                    f"(expected {list(want)}); recompute it with budgets.split_ratios() or "
                    f"set it to null"
                )
        return ratios

    def _check_source_and_model(self) -> None:
        if not isinstance(self.source, dict) or not isinstance(self.source.get("kind"), str):
            raise ProfileError(
                f"source must be an object with a string 'kind' (e.g. 'calibrated'), "
                f"got {self.source!r}"
            )
        for name in ("source", "stats"):
            _check_jsonable(name, getattr(self, name))
        if not isinstance(self.stats, dict):
            raise ProfileError(f"stats must be an object, got {self.stats!r:.80}")
        self.sample_retention  # noqa: B018 -- validates stats["samples"] when present
        kind = self.source["kind"]
        if self.model is None:
            if kind not in MODEL_FREE_KINDS:
                raise ProfileError(
                    f"a {kind!r} profile must record the model it was calibrated for "
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


# ----- module helpers -----------------------------------------------------------------

# A JSON array of numbers spread over lines by json.dumps(indent=...): "[\n  1,\n  2\n]".
_NUMBER_LIST = re.compile(r"\[\n[-+0-9.eE,\s]*\]")


def _lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_lists(v) for v in value]
    return value


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _float_matrix(name: str, value: Any) -> tuple[tuple[float, ...], ...]:
    if not _is_sequence(value) or not all(_is_sequence(row) for row in value):
        raise ProfileError(f"{name} must be a list of lists of numbers, got {value!r:.80}")
    for li, row in enumerate(value):
        for h, x in enumerate(row):
            if not _is_number(x) or not math.isfinite(x):
                raise ProfileError(f"{name}[{li}][{h}] = {x!r} is not a finite number")
    return tuple(tuple(float(x) for x in row) for row in value)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _check_shape(name: str, matrix: Sequence[Sequence[Any]], rows: int, cols: int) -> None:
    if len(matrix) != rows:
        raise ProfileError(f"{name} has {len(matrix)} layers, expected {rows}")
    for li, row in enumerate(matrix):
        if len(row) != cols:
            raise ProfileError(f"{name}[{li}] has {len(row)} entries, expected {cols}")


def _check_budget_range(budgets: tuple[tuple[float, ...], ...]) -> None:
    for li, row in enumerate(budgets):
        if not row:
            raise ProfileError(f"budgets[{li}] is empty; every layer needs one budget per KV head")
        for h, b in enumerate(row):
            if not 0.0 < b <= 1.0:
                raise ProfileError(
                    f"budgets[{li}][{h}] = {b} is outside (0, 1]; a budget is the fraction of "
                    f"tokens a head keeps"
                )


def _check_groups(
    groups: Any, num_layers: int, num_heads: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    ok = _is_sequence(groups) and all(
        _is_sequence(layer) and all(_is_sequence(g) for g in layer) for layer in groups
    )
    if not ok:
        raise ProfileError(
            f"groups must be a list (layers) of lists (groups) of lists of head indices, got {groups!r:.80}"
        )
    if len(groups) != num_layers:
        raise ProfileError(f"groups has {len(groups)} layers, budgets has {num_layers}")
    result = tuple(_check_layer_groups(li, layer, num_heads) for li, layer in enumerate(groups))
    sizes = {len(layer[0]) for layer in result}
    if len(sizes) > 1:
        raise ProfileError(f"every layer must use the same group size, got sizes {sorted(sizes)}")
    return result


def _check_layer_groups(
    layer: int, layer_groups: Sequence[Sequence[Any]], num_heads: int
) -> tuple[tuple[int, ...], ...]:
    heads = [h for g in layer_groups for h in g]
    if any(isinstance(h, bool) or not isinstance(h, int) for h in heads):
        raise ProfileError(f"groups[{layer}] contains a non-integer head index: {layer_groups!r}")
    if sorted(heads) != list(range(num_heads)):
        raise ProfileError(
            f"groups[{layer}] = {_lists(layer_groups)} is not a partition of the KV heads "
            f"0..{num_heads - 1}: every head must appear in exactly one group"
        )
    sizes = {len(g) for g in layer_groups}
    if len(sizes) != 1:
        raise ProfileError(
            f"groups[{layer}] has groups of unequal sizes {sorted(sizes)}; all groups must "
            f"have heads_per_group heads"
        )
    return tuple(tuple(g) for g in layer_groups)


def _check_jsonable(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{name} must be JSON-serialisable: {exc}") from exc


def _check_header(data: dict[str, Any]) -> None:
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileError(
            f"not an sgl-ragged profile: 'format' is {data.get('format')!r}, "
            f"expected {PROFILE_FORMAT!r}"
        )
    if data.get("version") not in READABLE_VERSIONS:
        raise ProfileError(
            f"unsupported profile version {data.get('version')!r}; this sgl-ragged reads "
            f"versions {list(READABLE_VERSIONS)}: re-calibrate or use a matching sgl-ragged"
        )
    required = {"model", "source", "budgets", "groups"}
    known = required | {"format", "version", "mu", "sigma", "split_ratios", "stats"}
    if data["version"] >= 2:
        known |= {"tiers"}
    missing = sorted(required - data.keys())
    if missing:
        raise ProfileError(f"missing key(s) {missing}")
    unknown = sorted(data.keys() - known)
    if unknown:
        raise ProfileError(f"unknown key(s) {unknown}; known keys are {sorted(known)}")


def _check_heads_per_group(num_heads: int, heads_per_group: int) -> None:
    try:
        budget_math.check_heads_per_group(num_heads, heads_per_group)
    except ValueError as exc:
        raise ProfileError(str(exc)) from exc


# ----- constructors -------------------------------------------------------------------


def uniform_profile(
    ratio: float, num_layers: int, num_kv_heads: int, heads_per_group: int | None = None
) -> BudgetProfile:
    """A profile with B = ratio for every head (no calibration; fits any model of this shape).

    ``heads_per_group`` defaults to ``num_kv_heads``: one group per layer.
    """
    if not _is_number(ratio) or not 0.0 < ratio <= 1.0:
        raise ProfileError(f"uniform ratio must be in (0, 1], got {ratio!r}")
    if num_layers < 1 or num_kv_heads < 1:
        raise ProfileError(
            f"num_layers and num_kv_heads must be >= 1, got {num_layers} and {num_kv_heads}"
        )
    hpg = num_kv_heads if heads_per_group is None else heads_per_group
    _check_heads_per_group(num_kv_heads, hpg)
    budgets = tuple(tuple(float(ratio) for _ in range(num_kv_heads)) for _ in range(num_layers))
    groups = tuple(budget_math.adjacent_groups(num_kv_heads, hpg) for _ in range(num_layers))
    return BudgetProfile(
        None, budgets, groups, {"kind": "uniform", "rho": float(ratio)},
        split_ratios=budget_math.split_ratios(budgets, groups),
    )  # fmt: skip


def dynamic_profile(
    rho: float, num_layers: int, num_kv_heads: int, heads_per_group: int | None = None
) -> BudgetProfile:
    """The dynamic reference mode ("w/o TANGRAM"): full-size pages (B = 1 for every head) and
    per-input Eq. 3 selection at rho when pages are sealed; dropped tokens are masked, not freed.
    """
    full = uniform_profile(1.0, num_layers, num_kv_heads, heads_per_group)
    return BudgetProfile(None, full.budgets, full.groups, {"kind": "dynamic", "rho": float(rho)},
                         split_ratios=full.split_ratios)


def parse_dynamic_spec(spec: str) -> float:
    """The target ratio rho of a "dynamic:<rho>" spec; ProfileError for anything else."""
    return _parse_ratio_spec(spec, "dynamic", "a dynamic profile is 'dynamic:<rho>' with rho in "
                             "(0, 1], e.g. dynamic:0.3; got")


def parse_uniform_spec(spec: str) -> float:
    """The ratio of a "uniform:<ratio>" spec; ProfileError for anything else."""
    return _parse_ratio_spec(spec, "uniform", f"{UNIFORM_SPEC_HELP}, got")


def _parse_ratio_spec(spec: str, kind: str, help_text: str) -> float:
    """The number after "<kind>:" if it is in (0, 1]; else ProfileError "<help_text> <spec!r>"."""
    prefix, sep, rest = spec.partition(":")
    try:
        ratio = float(rest)
    except ValueError:
        ratio = math.nan
    if prefix.strip().lower() != kind or not sep or not 0.0 < ratio <= 1.0:
        raise ProfileError(f"{help_text} {spec!r}")
    return ratio


def spec_kind(spec: str) -> str:
    """The kind a --ragged-profile value names: "uniform" / "dynamic" for those specs (any
    case), else what precedes its first colon (a file path names no kind)."""
    return spec.partition(":")[0].strip().lower()


def resolve_profile(
    spec: str, shape: ModelShape, heads_per_group: int | None = None
) -> BudgetProfile:
    """Turn a --ragged-profile value into a profile that fits ``shape``.

    ``uniform:<ratio>`` builds a uniform profile; anything else is a profile file,
    loaded, checked against ``shape`` and regrouped (clustered) when
    ``heads_per_group`` is given and differs from the file's.
    """
    if heads_per_group is not None:
        _check_heads_per_group(shape.num_kv_heads, heads_per_group)
    kind = spec_kind(spec)
    if kind == "uniform":
        ratio = parse_uniform_spec(spec)
        return uniform_profile(ratio, shape.num_layers, shape.num_kv_heads, heads_per_group)
    if kind == "dynamic":
        return dynamic_profile(parse_dynamic_spec(spec), shape.num_layers, shape.num_kv_heads,
                               heads_per_group)
    if not spec.strip():
        raise ProfileError("empty profile spec; pass a profile file or uniform:<ratio in (0,1]>")
    profile = BudgetProfile.load(spec)
    profile.check_model(shape)
    if heads_per_group is not None and heads_per_group != profile.heads_per_group:
        profile = profile.regrouped(heads_per_group, clustered=True)
    return profile
