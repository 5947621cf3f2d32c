"""Pipeline-parallel slicing of profiles (sgl_ragged/pp.py): a stage's layers of every per-layer
field, the source entry, refusals, the tensor-parallel slice of a stage, and the stage that
SGLang's layer info names (serving/runtime.py)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from sgl_ragged.budgets import adjacent_groups, cluster_heads, split_ratios
from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.pp import PP_SOURCE_KEY, slice_layers
from sgl_ragged.profile import BudgetProfile, ModelShape, ProfileError, resolve_profile
from sgl_ragged.profile.tiers import ProfileTiers
from sgl_ragged.serving import runtime
from sgl_ragged.tp import resolve_rank_profiles, slice_profile

LAYERS, HEADS = 5, 4
SHAPE = ModelShape("LlamaForCausalLM", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=16)
FORMATS = ("int8", "int4", "int2")


def calibrated(seed: int = 0, adjacent: bool = False) -> BudgetProfile:
    """A calibrated profile with every per-layer field set: budgets, groups of 2, mu / sigma,
    split ratios, per-head mixed tiers, and per-sample retention in its stats."""
    rng = random.Random(seed)
    budgets = tuple(tuple(round(rng.uniform(0.05, 1.0), 4) for _ in range(HEADS)) for _ in range(LAYERS))
    # groups of 2 clustered by budget, or the adjacent pairs (which lie within tp-2 ranks)
    groups = tuple(adjacent_groups(HEADS, 2) if adjacent else cluster_heads(layer, 2)
                   for layer in budgets)
    hi = [[0.0] * HEADS for _ in range(LAYERS)]
    lo = [[0.0] * HEADS for _ in range(LAYERS)]
    formats = [[""] * HEADS for _ in range(LAYERS)]
    for li, layer_groups in enumerate(groups):
        for group in layer_groups:  # heads of a group share their composition and format
            share_hi, share_lo, fmt = rng.choice((0.0, 0.03125)), rng.uniform(0.2, 0.9), rng.choice(FORMATS)
            for h in group:
                hi[li][h], lo[li][h], formats[li][h] = share_hi, round(share_lo, 4), fmt
    tiers = ProfileTiers("mixed", tuple(map(tuple, hi)), tuple(map(tuple, lo)), tuple(map(tuple, formats)))
    return BudgetProfile(SHAPE, budgets, groups, {"kind": "calibrated", "rho": 0.3},
                         mu=budgets, sigma=tuple(tuple(0.01 * (h + 1) for h in range(HEADS)) for _ in budgets),
                         split_ratios=split_ratios(budgets, groups),
                         stats={"coverage": 0.9, "samples": {
                             "tasks": ["qa", "code"], "tokens": [100, 200],
                             "retention": [[[round(0.1 * li + 0.01 * s, 4)] * HEADS for li in range(LAYERS)]
                                           for s in range(2)]}},
                         tiers=tiers)


def brute_force_stage(profile: BudgetProfile, start: int, end: int) -> dict:
    """Each field of layers start..end-1, layer by layer."""
    def rows(matrix):
        return None if matrix is None else tuple(matrix[li] for li in range(start, end))

    return {"budgets": rows(profile.budgets), "groups": rows(profile.groups), "mu": rows(profile.mu),
            "sigma": rows(profile.sigma), "split_ratios": rows(profile.split_ratios),
            "hi": rows(profile.tiers.hi), "lo": rows(profile.tiers.lo),
            "formats": rows(profile.tiers.formats)}


@pytest.mark.parametrize("start, end", [(0, 2), (2, 5), (1, 4), (4, 5), (0, 1)])
def test_a_stage_keeps_its_layers_of_every_field(start: int, end: int) -> None:
    profile = calibrated(seed=start * 7 + end)
    part = slice_layers(profile, start, end)
    want = brute_force_stage(profile, start, end)
    got = {"budgets": part.budgets, "groups": part.groups, "mu": part.mu, "sigma": part.sigma,
           "split_ratios": part.split_ratios, "hi": part.tiers.hi, "lo": part.tiers.lo,
           "formats": part.tiers.formats}
    assert got == want
    # split ratios are per layer (Phi[l, g] / Omega[l]): recomputing them on the stage agrees
    assert part.split_ratios == split_ratios(part.budgets, part.groups)
    assert part.model == ModelShape("LlamaForCausalLM", end - start, HEADS, 16)
    assert part.tiers.precision == "mixed"
    assert part.source[PP_SOURCE_KEY] == {"start_layer": start, "end_layer": end, "num_layers": LAYERS}
    assert part.source["kind"] == "calibrated" and part.source["rho"] == 0.3
    samples = profile.stats["samples"]
    assert part.stats == {"coverage": 0.9, "samples": {  # each sample's retention of the layers
        **samples, "retention": [[s[li] for li in range(start, end)] for s in samples["retention"]]}}
    assert part.sample_retention.retention == tuple(
        tuple(tuple(row) for row in s[start:end]) for s in samples["retention"])


def test_stages_partition_the_layers_and_their_rows() -> None:
    profile = calibrated()
    whole = RaggedLayout.from_profile(profile, 64, 16, 2, precision="mixed")
    stages = [slice_layers(profile, 0, 2), slice_layers(profile, 2, 4), slice_layers(profile, 4, 5)]
    assert sum((s.budgets for s in stages), ()) == profile.budgets
    layouts = [RaggedLayout.from_profile(s, 64, 16, 2, precision="mixed") for s in stages]
    assert [lay.num_layers for lay in layouts] == [2, 2, 1]
    # every stage stores exactly the whole model's rows of its layers, tiers included
    assert sum(lay.row_bytes_per_page for lay in layouts) == whole.row_bytes_per_page
    assert [lay.low_format(0, 0) for lay in layouts] == [whole.low_format(li, 0) for li in (0, 2, 4)]


def test_the_whole_range_is_the_profile_itself() -> None:
    profile = calibrated()
    assert slice_layers(profile, 0, LAYERS) is profile


@pytest.mark.parametrize("start, end", [(2, 2), (3, 1), (-1, 2), (0, LAYERS + 1)])
def test_a_range_outside_the_model_is_refused(start: int, end: int) -> None:
    with pytest.raises(ProfileError, match=rf"layers \[{start}, {end}\) are not a non-empty range "
                                           rf"of the model's {LAYERS} layers"):
        slice_layers(calibrated(), start, end)


def test_a_sliced_stage_is_a_valid_profile_file(tmp_path: Path) -> None:
    part = slice_layers(calibrated(), 1, 3)
    path = tmp_path / "stage.json"
    part.save(path)
    assert BudgetProfile.load(path) == part


def test_model_free_profiles_slice_to_the_stage() -> None:
    part = resolve_rank_profiles("uniform:0.4", SHAPE, None, 1, layers=(3, 5))[0]
    assert part.num_layers == 2 and part.budgets == resolve_profile("uniform:0.4", SHAPE).budgets[3:5]
    dynamic = resolve_rank_profiles("dynamic:0.3", SHAPE, None, 1, layers=(0, 2))[0]
    assert dynamic.source.is_dynamic and dynamic.num_layers == 2


def test_a_stage_sliced_per_tensor_parallel_rank_is_the_rank_slice_of_its_layers(tmp_path: Path) -> None:
    profile = calibrated(adjacent=True)  # per-group tiers need groups within a rank
    path = tmp_path / "profile.json"
    profile.save(path)
    for layers in ((0, 3), (3, 5)):
        ranks = resolve_rank_profiles(str(path), SHAPE, None, 2, layers=layers)
        for rank, part in enumerate(ranks):
            # the other order: the rank's heads of every layer, then the stage's layers
            other = slice_layers(slice_profile(BudgetProfile.load(path), 2, rank), *layers)
            for field in ("budgets", "groups", "mu", "sigma", "split_ratios", "tiers", "model"):
                assert getattr(part, field) == getattr(other, field), (layers, rank, field)
            assert part.source[PP_SOURCE_KEY]["start_layer"] == layers[0]
            assert part.source["tensor_parallel"]["rank"] == rank
    # --ragged-heads-per-group applies within the stage's layers as without stages
    plain = tmp_path / "no-tiers.json"
    dataclasses.replace(profile, tiers=None).save(plain)
    one = resolve_rank_profiles(str(plain), SHAPE, 1, 1, layers=(1, 4))[0]
    assert one.heads_per_group == 1 and one.budgets == profile.budgets[1:4]


def test_build_setup_lays_out_the_stage() -> None:
    config = RaggedConfig(profile="uniform:0.3", window_pages=1)
    setup = runtime.build_setup(config, SHAPE, page_size=16, dtype_bytes=2, max_running_requests=2,
                                tp_size=1, tp_rank=0, attention_scale=0.25, layers=(2, 5))
    assert setup.start_layer == 2 and setup.layout.num_layers == 3
    assert setup.profile.source[PP_SOURCE_KEY]["start_layer"] == 2
    whole = runtime.build_setup(config, SHAPE, page_size=16, dtype_bytes=2, max_running_requests=2,
                                tp_size=1, tp_rank=0, attention_scale=0.25)
    assert whole.start_layer == 0 and whole.layout.num_layers == LAYERS


def test_pipeline_stage_from_sglang_layer_info() -> None:
    info = SimpleNamespace
    assert runtime.pipeline_stage(info(start_layer=0, end_layer=30), 30, 30) is None
    assert runtime.pipeline_stage(info(start_layer=0, end_layer=15), 15, 30) == (0, 15)
    assert runtime.pipeline_stage(info(start_layer=15, end_layer=30), 15, 30) == (15, 30)
    with pytest.raises(ValueError, match=r"KV pool for 60 layers, but this scheduler holds layers "
                                         r"\[0, 30\).*one KV layer per model layer"):
        runtime.pipeline_stage(info(start_layer=0, end_layer=30), 60, 30)
