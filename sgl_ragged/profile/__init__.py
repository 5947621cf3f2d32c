"""Budget profiles: per-(layer, KV head) budgets and head groups, their file format and the
``--ragged-profile`` specs (docs/calibration.md).

budget_profile.py (``BudgetProfile``, JSON I/O) <- model_shape.py, samples.py, tiers.py (its
parts, with source.py: the typed ``source`` record) and validation.py (load-time checks,
``ProfileError``); spec.py parses ``uniform:``, ``dynamic:`` and files.
"""

from __future__ import annotations

from sgl_ragged.profile.budget_profile import CALIBRATE_HINT, BudgetProfile
from sgl_ragged.profile.model_shape import ModelShape, model_shape
from sgl_ragged.profile.samples import STATS_SCHEMA, SampleRetention
from sgl_ragged.profile.source import ModelFreeKind, SourceRecord
from sgl_ragged.profile.spec import (
    UNIFORM_SPEC_HELP,
    dynamic_profile,
    model_free_kind,
    model_free_profile,
    parse_dynamic_spec,
    parse_uniform_spec,
    profile_precision,
    profile_tiers,
    resolve_profile,
    uniform_profile,
)
from sgl_ragged.profile.tiers import ProfileTiers
from sgl_ragged.profile.validation import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    READABLE_VERSIONS,
    ProfileError,
)

__all__ = [
    "CALIBRATE_HINT",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "READABLE_VERSIONS",
    "STATS_SCHEMA",
    "UNIFORM_SPEC_HELP",
    "BudgetProfile",
    "ModelFreeKind",
    "ModelShape",
    "ProfileError",
    "ProfileTiers",
    "SampleRetention",
    "SourceRecord",
    "dynamic_profile",
    "model_free_kind",
    "model_free_profile",
    "model_shape",
    "parse_dynamic_spec",
    "parse_uniform_spec",
    "profile_precision",
    "profile_tiers",
    "resolve_profile",
    "uniform_profile",
]
