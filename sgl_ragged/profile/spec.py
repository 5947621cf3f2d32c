"""``--ragged-profile`` values: ``uniform:<ratio>``, ``dynamic:<rho>`` or a profile file.

The two model-free specs build their profile for the model's shape; a file is loaded, checked
against the model and regrouped when asked.
"""

from __future__ import annotations

import math

import sgl_ragged.budgets as budget_math
from sgl_ragged.profile.budget_profile import BudgetProfile
from sgl_ragged.profile.model_shape import ModelShape
from sgl_ragged.profile.source import ModelFreeKind, SourceRecord
from sgl_ragged.profile.tiers import ProfileTiers
from sgl_ragged.profile.validation import ProfileError, check_heads_per_group, is_number

UNIFORM_SPEC_HELP = "expected uniform:<ratio in (0,1]>"
DYNAMIC_SPEC_HELP = "a dynamic profile is 'dynamic:<rho>' with rho in (0, 1], e.g. dynamic:0.3; got"


def uniform_profile(
    ratio: float, num_layers: int, num_kv_heads: int, heads_per_group: int | None = None
) -> BudgetProfile:
    """A profile with B = ratio for every head (no calibration; fits any model of this shape).

    ``heads_per_group`` defaults to ``num_kv_heads``: one group per layer.
    """
    if not is_number(ratio) or not 0.0 < ratio <= 1.0:
        raise ProfileError(f"uniform ratio must be in (0, 1], got {ratio!r}")
    if num_layers < 1 or num_kv_heads < 1:
        raise ProfileError(
            f"num_layers and num_kv_heads must be >= 1, got {num_layers} and {num_kv_heads}"
        )
    hpg = num_kv_heads if heads_per_group is None else heads_per_group
    check_heads_per_group(num_kv_heads, hpg)
    budgets = tuple(tuple(float(ratio) for _ in range(num_kv_heads)) for _ in range(num_layers))
    groups = tuple(budget_math.adjacent_groups(num_kv_heads, hpg) for _ in range(num_layers))
    return BudgetProfile(
        None, budgets, groups, SourceRecord.model_free(ModelFreeKind.UNIFORM, ratio),
        split_ratios=budget_math.split_ratios(budgets, groups),
    )  # fmt: skip


def dynamic_profile(
    rho: float, num_layers: int, num_kv_heads: int, heads_per_group: int | None = None
) -> BudgetProfile:
    """The dynamic reference mode ("w/o TANGRAM"): full-size pages (B = 1 for every head) and
    per-input Eq. 3 selection at rho when pages are sealed; dropped tokens are masked, not freed.
    """
    full = uniform_profile(1.0, num_layers, num_kv_heads, heads_per_group)
    return BudgetProfile(None, full.budgets, full.groups,
                         SourceRecord.model_free(ModelFreeKind.DYNAMIC, rho),
                         split_ratios=full.split_ratios)  # fmt: skip


def model_free_kind(spec: str) -> ModelFreeKind | None:
    """The model-free source a --ragged-profile value names by what precedes its first colon
    (``uniform``, ``dynamic``, any case), or None: a profile file."""
    try:
        return ModelFreeKind(spec.partition(":")[0].strip().lower())
    except ValueError:
        return None


def profile_precision(spec: str) -> str | None:
    """The --ragged-precision a profile file was written for: its tiers' precision
    (`sgl-ragged profile tiers`: ``mixed`` for per-head formats, else one precision or pair),
    or None where profile_tiers is None."""
    tiers = profile_tiers(spec)
    return None if tiers is None else tiers.precision


def profile_tiers(spec: str) -> ProfileTiers | None:
    """A profile file's tiers (`sgl-ragged profile tiers`: the precision, and the rotation,
    they were searched for), or None for the model-free specs, files without tiers, and files
    that do not load (resolve_profile reports those, with the model at hand)."""
    if not spec.strip() or model_free_kind(spec) is not None:
        return None
    try:
        profile = BudgetProfile.load(spec)  # the file resolve_profile loads
    except ProfileError:
        return None
    return profile.tiers


def parse_dynamic_spec(spec: str) -> float:
    """The target ratio rho of a "dynamic:<rho>" spec; ProfileError for anything else."""
    return _parse_ratio_spec(spec, ModelFreeKind.DYNAMIC, DYNAMIC_SPEC_HELP)


def parse_uniform_spec(spec: str) -> float:
    """The ratio of a "uniform:<ratio>" spec; ProfileError for anything else."""
    return _parse_ratio_spec(spec, ModelFreeKind.UNIFORM, f"{UNIFORM_SPEC_HELP}, got")


def _parse_ratio_spec(spec: str, kind: ModelFreeKind, help_text: str) -> float:
    """The number after "<kind>:" if it is in (0, 1]; else ProfileError "<help_text> <spec!r>"."""
    _, sep, rest = spec.partition(":")
    try:
        ratio = float(rest)
    except ValueError:
        ratio = math.nan
    if model_free_kind(spec) is not kind or not sep or not 0.0 < ratio <= 1.0:
        raise ProfileError(f"{help_text} {spec!r}")
    return ratio


_MODEL_FREE_BUILDERS = {
    ModelFreeKind.UNIFORM: (parse_uniform_spec, uniform_profile),
    ModelFreeKind.DYNAMIC: (parse_dynamic_spec, dynamic_profile),
}


def model_free_profile(spec: str, num_layers: int, num_kv_heads: int,
                       heads_per_group: int | None = None) -> BudgetProfile:
    """The profile of a ``uniform:<ratio>`` or ``dynamic:<rho>`` spec for this shape."""
    kind = model_free_kind(spec)
    if kind is None:
        raise ProfileError(f"{spec!r} is a profile file, not uniform:<ratio> or dynamic:<rho>")
    parse, build = _MODEL_FREE_BUILDERS[kind]
    return build(parse(spec), num_layers, num_kv_heads, heads_per_group)


def resolve_profile(
    spec: str, shape: ModelShape, heads_per_group: int | None = None
) -> BudgetProfile:
    """Turn a --ragged-profile value into a profile that fits ``shape``.

    ``uniform:<ratio>`` builds a uniform profile, ``dynamic:<rho>`` the dynamic reference
    mode's; anything else is a profile file, loaded, checked against ``shape`` and regrouped
    (clustered) when ``heads_per_group`` is given and differs from the file's.
    """
    if heads_per_group is not None:
        check_heads_per_group(shape.num_kv_heads, heads_per_group)
    if model_free_kind(spec) is not None:
        return model_free_profile(spec, shape.num_layers, shape.num_kv_heads, heads_per_group)
    if not spec.strip():
        raise ProfileError("empty profile spec; pass a profile file or uniform:<ratio in (0,1]>")
    profile = BudgetProfile.load(spec)
    profile.check_model(shape)
    if heads_per_group is not None and heads_per_group != profile.heads_per_group:
        profile = profile.regrouped(heads_per_group, clustered=True)
    return profile
