"""Pipeline parallelism: each stage's layers of a budget profile (docs/architecture.md, "Scaling out").

SGLang's pipeline parallelism (`--pp-size P`) gives stage s the contiguous layers
`[start_layer, end_layer)` of the model, and its KV pool holds only those. Each stage serves
the whole-model profile's slice of them: per layer, budgets, head groups, split ratios (they
are per layer already: Phi[l, g] / Omega[l]) and row tiers are the layer's own, so a stage
keeps exactly the tokens per head the whole model would keep in its layers. Calibrated
profiles stay whole-model files; slicing happens at load, before the tensor-parallel slice of
the stage's layers (tp.py).

Stages differ in bytes per logical page (their layers' budgets differ); SGLang already takes
the smallest token capacity over the pipeline's ranks (an all-reduce MIN in its KV cache
configurator), so no stage can run out of pages first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from sgl_ragged.profile import BudgetProfile, ProfileError

T = TypeVar("T")

PP_SOURCE_KEY = "pipeline_parallel"  # source entry of a sliced profile: {start_layer, end_layer, num_layers}


def check_stage(num_layers: int, start_layer: int, end_layer: int) -> None:
    """ProfileError unless [start_layer, end_layer) is a non-empty range of the model's layers."""
    if not 0 <= start_layer < end_layer <= num_layers:
        raise ProfileError(
            f"pipeline stage layers [{start_layer}, {end_layer}) are not a non-empty range of the "
            f"model's {num_layers} layers"
        )


def slice_layers(profile: BudgetProfile, start_layer: int, end_layer: int) -> BudgetProfile:
    """The stage's profile over its layers [start_layer, end_layer), as local layers
    0..end_layer - start_layer - 1 (global layer = start_layer + local)."""
    check_stage(profile.num_layers, start_layer, end_layer)
    if (start_layer, end_layer) == (0, profile.num_layers):
        return profile
    span = slice(start_layer, end_layer)

    def pick(matrix: Sequence[T] | None) -> Sequence[T] | None:
        return None if matrix is None else matrix[span]

    model = profile.model
    if model is not None:
        model = dataclasses.replace(model, num_layers=end_layer - start_layer)
    source = profile.source.updated({PP_SOURCE_KEY: {
        "start_layer": start_layer, "end_layer": end_layer, "num_layers": profile.num_layers}})
    stats = dict(profile.stats)
    if "samples" in stats:  # per-sample retention [S][L][H]: the stage's layers of each sample
        samples = stats["samples"]
        stats["samples"] = {**samples, "retention": [s[span] for s in samples["retention"]]}
    tiers = profile.tiers and dataclasses.replace(
        profile.tiers, hi=pick(profile.tiers.hi), lo=pick(profile.tiers.lo),
        formats=pick(profile.tiers.formats))
    return BudgetProfile(model, profile.budgets[span], profile.groups[span], source,
                         pick(profile.mu), pick(profile.sigma), pick(profile.split_ratios), stats,
                         tiers)
