"""Unit tests of sgl_ragged.profile: validation, file format, model checks, slots, specs."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ragged.budgets import cluster_heads, split_ratios
from sgl_ragged.profile import (
    BudgetProfile,
    ModelShape,
    ProfileError,
    resolve_profile,
    uniform_profile,
)

SHAPE = ModelShape("LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_dim=64)
BUDGETS = ((0.2, 0.9, 0.4, 0.5), (1.0, 0.3, 0.3, 0.6))


def make_profile(heads_per_group: int = 2) -> BudgetProfile:
    """A calibrated-looking profile of SHAPE with every optional field filled."""
    groups = tuple(cluster_heads(layer, heads_per_group) for layer in BUDGETS)
    return BudgetProfile(
        model=SHAPE,
        budgets=BUDGETS,
        groups=groups,
        source={"kind": "calibrated", "scorer": "snapkv", "scorer_params": {"window": 32},
                "rho": 0.3, "alpha": 2.0, "samples": 50, "sample_source": "synthetic"},
        mu=((0.1, 0.5, 0.2, 0.3), (0.8, 0.1, 0.1, 0.4)),
        sigma=((0.05, 0.2, 0.1, 0.1), (0.1, 0.1, 0.1, 0.1)),
        split_ratios=split_ratios(BUDGETS, groups),
        stats={"rank_stability": 0.93, "coverage": [0.97, 0.99]},
    )  # fmt: skip


@pytest.fixture
def profile() -> BudgetProfile:
    return make_profile()


@pytest.fixture
def profile_file(tmp_path: Path, profile: BudgetProfile) -> Path:
    path = tmp_path / "llama-snapkv-r30.json"
    profile.save(path)
    return path


# ----- construction and derived values ---------------------------------------------------


def test_properties(profile: BudgetProfile) -> None:
    assert (profile.num_layers, profile.num_kv_heads) == (2, 4)
    assert (profile.heads_per_group, profile.num_groups) == (2, 2)
    assert profile.mean_budget == pytest.approx(sum(map(sum, BUDGETS)) / 8)
    assert profile.groups[0] == ((0, 2), (1, 3))  # 0.2, 0.4 | 0.5, 0.9
    assert profile.group_budgets == ((0.4, 0.9), (0.3, 1.0))


def test_lists_are_converted_to_tuples() -> None:
    p = BudgetProfile(None, [[0.5, 0.5]], [[[0, 1]]], {"kind": "uniform"}, split_ratios=[[1.0]])
    assert p.budgets == ((0.5, 0.5),) and p.groups == (((0, 1),),)
    assert p.split_ratios == ((1.0,),)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"budgets": ((0.2, 0.9, 0.4, 1.5), BUDGETS[1])},
            r"budgets\[0\]\[3\] = 1.5 is outside \(0, 1\]",
        ),
        ({"budgets": ((0.0, 0.9, 0.4, 0.5), BUDGETS[1])}, r"budgets\[0\]\[0\] = 0.0 is outside"),
        (
            {"budgets": ((0.2, math.nan, 0.4, 0.5), BUDGETS[1])},
            r"budgets\[0\]\[1\] = nan is not a finite",
        ),
        ({"budgets": ((0.2, 0.9, 0.4), BUDGETS[1])}, r"budgets\[1\] has 4 entries, expected 3"),
        ({"budgets": ()}, "at least one layer"),
        ({"groups": (((0, 2), (1, 3)),)}, "groups has 1 layers, budgets has 2"),
        ({"groups": (((0, 2), (1, 2)), ((0, 1), (2, 3)))}, r"groups\[0\] .* not a partition"),
        (
            {"groups": (((0, 1, 2), (3,)), ((0, 1), (2, 3)))},
            r"groups\[0\] has groups of unequal sizes",
        ),
        ({"groups": (((0, 1, 2, 3),), ((0, 1), (2, 3)))}, "same group size"),
        ({"mu": ((0.1,) * 4,)}, "mu has 1 layers, expected 2"),
        ({"sigma": ((-0.1,) * 4, (0.1,) * 4)}, r"sigma\[0\]\[0\] = -0.1 is outside"),
        ({"split_ratios": ((0.5, 0.5), (0.5, 0.5))}, r"split_ratios\[0\] .* does not match"),
        ({"split_ratios": ((1.0,), (1.0,))}, r"split_ratios\[0\] has 1 entries, expected 2"),
        ({"source": {"scorer": "snapkv"}}, "string 'kind'"),
        ({"source": {"kind": "calibrated", "bad": {1, 2}}}, "source must be JSON-serialisable"),
        ({"stats": {"x": math.inf}}, "stats must be JSON-serialisable"),
        ({"model": None}, "'calibrated' profile must record the model"),
        ({"model": ModelShape("LlamaForCausalLM", 3, 4, 64)}, "model has 3 layers and 4 KV heads"),
    ],
)
def test_invalid_profiles_are_refused(changes: dict[str, Any], message: str) -> None:
    fields = {**make_profile().__dict__, **changes}
    with pytest.raises(ProfileError, match=message):
        BudgetProfile(**fields)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 2, 4, 64), "architecture must be a non-empty string"),
        (("Llama", 0, 4, 64), "num_layers must be a positive int"),
        (("Llama", 2, 4.0, 64), "num_kv_heads must be a positive int"),
    ],
)
def test_invalid_model_shape(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        ModelShape(*args)


# ----- model check -----------------------------------------------------------------------


def test_differences_lines() -> None:
    other = ModelShape("Qwen3ForCausalLM", 2, 3, 64)
    assert SHAPE.differences(other) == [
        "architecture: profile has LlamaForCausalLM, model has Qwen3ForCausalLM",
        "num_kv_heads: profile has 4, model has 3",
    ]
    assert SHAPE.differences(SHAPE) == []


@pytest.mark.parametrize(
    ("shape", "line"),
    [
        (
            ModelShape("MistralForCausalLM", 2, 4, 64),
            "architecture: profile has LlamaForCausalLM, model has MistralForCausalLM",
        ),
        (ModelShape("LlamaForCausalLM", 3, 4, 64), "num_layers: profile has 2, model has 3"),
        (ModelShape("LlamaForCausalLM", 2, 8, 64), "num_kv_heads: profile has 4, model has 8"),
        (ModelShape("LlamaForCausalLM", 2, 4, 128), "head_dim: profile has 64, model has 128"),
    ],
)
def test_check_model_names_the_differing_field(
    profile: BudgetProfile, shape: ModelShape, line: str
) -> None:
    with pytest.raises(ProfileError) as info:
        profile.check_model(shape)
    message = str(info.value)
    assert line in message
    named = [
        f for f in ("architecture", "num_layers", "num_kv_heads", "head_dim") if f"{f}:" in message
    ]
    assert named == [line.split(":")[0]]


def test_check_model_lists_every_difference_and_the_fix(profile: BudgetProfile) -> None:
    with pytest.raises(ProfileError) as info:
        profile.check_model(ModelShape("Qwen3ForCausalLM", 36, 8, 128))
    message = str(info.value)
    for line in (
        "architecture: profile has LlamaForCausalLM, model has Qwen3ForCausalLM",
        "num_layers: profile has 2, model has 36",
        "num_kv_heads: profile has 4, model has 8",
        "head_dim: profile has 64, model has 128",
        "this profile was calibrated for LlamaForCausalLM with 2 layers, 4 KV heads, head_dim 64",
        "python -m sgl_ragged.calibrate --model",
        "uniform:<ratio>",
    ):
        assert line in message


def test_check_model_accepts_matching_model(profile: BudgetProfile) -> None:
    profile.check_model(ModelShape("LlamaForCausalLM", 2, 4, 64))


def test_check_model_of_model_free_profile_compares_its_shape() -> None:
    p = uniform_profile(0.3, num_layers=2, num_kv_heads=4)
    p.check_model(ModelShape("AnyForCausalLM", 2, 4, 32))
    with pytest.raises(ProfileError, match="num_kv_heads: profile has 4, model has 8"):
        p.check_model(ModelShape("AnyForCausalLM", 2, 8, 32))


# ----- slots -----------------------------------------------------------------------------


@st.composite
def random_profiles(draw: st.DrawFn) -> BudgetProfile:
    hpg = draw(st.sampled_from([1, 2, 4]))
    num_heads = hpg * draw(st.integers(min_value=1, max_value=4))
    num_layers = draw(st.integers(min_value=1, max_value=3))
    budget = st.floats(min_value=1e-6, max_value=1.0)
    budgets = draw(st.lists(st.lists(budget, min_size=num_heads, max_size=num_heads),
                            min_size=num_layers, max_size=num_layers))  # fmt: skip
    groups = [cluster_heads(layer, hpg) for layer in budgets]
    shape = ModelShape("TestForCausalLM", num_layers, num_heads, 64)
    return BudgetProfile(shape, budgets, groups, {"kind": "calibrated"})


def brute_force_slots(budgets, groups, page_size: int, min_slots: int) -> list[list[int]]:
    """Smallest k in [min_slots, P] with k >= B_g * P (up to 1e-9 float noise), else P."""
    result = []
    for layer, layer_groups in zip(budgets, groups, strict=True):
        row = []
        for group in layer_groups:
            need = max(layer[h] for h in group) * page_size
            row.append(
                next((k for k in range(min_slots, page_size + 1) if k >= need - 1e-9), page_size)
            )
        result.append(row)
    return result


@settings(max_examples=300, deadline=None)
@given(random_profiles(), st.sampled_from([4, 8, 16, 64, 128]), st.integers(1, 4))
def test_slots_per_group_matches_brute_force(
    p: BudgetProfile, page_size: int, min_slots: int
) -> None:
    got = p.slots_per_group(page_size, min_slots)
    assert [list(row) for row in got] == brute_force_slots(
        p.budgets, p.groups, page_size, min_slots
    )


def test_slots_per_group_hand_example(profile: BudgetProfile) -> None:
    # Group budgets ((0.4, 0.9), (0.3, 1.0)) at P = 64: ceil(25.6) = 26, ceil(57.6) = 58, ...
    assert profile.slots_per_group(64) == ((26, 58), (20, 64))
    assert uniform_profile(0.01, 1, 4).slots_per_group(64) == ((4,),)  # sink tokens
    assert uniform_profile(0.07, 1, 4).slots_per_group(100, min_slots=1) == (
        (7,),
    )  # 7.000000000000001


@pytest.mark.parametrize(("page_size", "min_slots"), [(2, 4), (0, 1), (16, 0)])
def test_slots_per_group_rejects_bad_sizes(page_size: int, min_slots: int) -> None:
    with pytest.raises(ProfileError, match="page_size"):
        make_profile().slots_per_group(page_size, min_slots)


def test_split_map_uses_algorithm1(profile: BudgetProfile) -> None:
    # Layer 0: Omega 2.0, groups (0.6, 1.4) of 20 CTAs -> (6, 14).
    assert profile.split_map(20)[0] == (6, 14)


# ----- regrouping ------------------------------------------------------------------------


@pytest.mark.parametrize("hpg", [1, 2, 4])
def test_regrouped_clustered(profile: BudgetProfile, hpg: int) -> None:
    p = profile.regrouped(hpg)
    assert p.heads_per_group == hpg
    assert p.groups == tuple(cluster_heads(layer, hpg) for layer in BUDGETS)
    assert p.split_ratios == split_ratios(BUDGETS, p.groups)
    assert (p.budgets, p.mu, p.sigma, p.model) == (
        profile.budgets,
        profile.mu,
        profile.sigma,
        SHAPE,
    )


def test_regrouped_adjacent(profile: BudgetProfile) -> None:
    p = profile.regrouped(2, clustered=False)
    assert p.groups == (((0, 1), (2, 3)),) * 2


def test_regrouped_rejects_non_divisor(profile: BudgetProfile) -> None:
    with pytest.raises(
        ProfileError, match=r"heads_per_group=3 does not divide the 4 KV heads.*\[1, 2, 4\]"
    ):
        profile.regrouped(3)


# ----- file format -----------------------------------------------------------------------


def test_save_load_round_trip(profile: BudgetProfile, profile_file: Path) -> None:
    assert BudgetProfile.load(profile_file) == profile
    assert BudgetProfile.load(str(profile_file)) == profile
    assert BudgetProfile.from_dict(profile.to_dict()) == profile


def test_round_trip_of_uniform_profile(tmp_path: Path) -> None:
    p = uniform_profile(0.3, num_layers=3, num_kv_heads=8, heads_per_group=2)
    p.save(tmp_path / "u.json")
    assert BudgetProfile.load(tmp_path / "u.json") == p


@settings(max_examples=50, deadline=None)
@given(random_profiles())
def test_round_trip_is_exact_for_random_budgets(p: BudgetProfile) -> None:
    assert BudgetProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_file_is_pretty_and_self_describing(profile_file: Path) -> None:
    text = profile_file.read_text()
    data = json.loads(text)
    assert data["format"] == "sgl-ragged-profile" and data["version"] == 2
    assert data["model"] == {"architecture": "LlamaForCausalLM", "num_layers": 2,
                             "num_kv_heads": 4, "head_dim": 64}  # fmt: skip
    assert data["source"]["kind"] == "calibrated"
    assert "\n" in text and "[0.2, 0.9, 0.4, 0.5]" in text  # one budget row per line
    assert not list(profile_file.parent.glob("*.tmp"))


def write_json(data: Any) -> Callable[[Path], None]:
    return lambda path: path.write_text(json.dumps(data))


def edited(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        data = make_profile().to_dict()
        edit(data)
        path.write_text(json.dumps(data))

    return write


MALFORMED_FILES: list[tuple[str, Callable[[Path], None], str]] = [
    ("not-json", lambda p: p.write_text("{not json"), "is not valid JSON"),
    ("binary", lambda p: p.write_bytes(b"\xff\xfe\x00"), "is not valid JSON"),
    ("empty", lambda p: p.write_text(""), "is not valid JSON"),
    ("list", write_json([1, 2]), "must be a JSON object, got list"),
    ("no-format", edited(lambda d: d.pop("format")), "not an sgl-ragged profile: 'format' is None"),
    ("wrong-format", edited(lambda d: d.update(format="kvpress")), "'format' is 'kvpress'"),
    ("wrong-version", edited(lambda d: d.update(version=5)), "unsupported profile version 5"),
    ("no-version", edited(lambda d: d.pop("version")), "unsupported profile version None"),
    ("no-budgets", edited(lambda d: d.pop("budgets")), r"missing key\(s\) \['budgets'\]"),
    ("no-groups", edited(lambda d: d.pop("groups")), r"missing key\(s\) \['groups'\]"),
    ("no-model", edited(lambda d: d.pop("model")), r"missing key\(s\) \['model'\]"),
    ("no-source", edited(lambda d: d.pop("source")), r"missing key\(s\) \['source'\]"),
    ("unknown-key", edited(lambda d: d.update(budget=[])), r"unknown key\(s\) \['budget'\]"),
    ("budget-string", edited(lambda d: d["budgets"][1].__setitem__(0, "0.5")), r"budgets\[1\]\[0\] = '0.5' is not a finite number"),
    ("budget-too-big", edited(lambda d: d["budgets"][0].__setitem__(2, 2.0)), r"budgets\[0\]\[2\] = 2.0 is outside"),
    ("budgets-not-nested", edited(lambda d: d.update(budgets="0.3")), "budgets must be a list of lists"),
    ("groups-overlap", edited(lambda d: d["groups"][1].__setitem__(0, [1, 3])), r"groups\[1\] .* not a partition"),
    ("groups-bad-index", edited(lambda d: d["groups"][0].__setitem__(0, [0, "2"])), "non-integer head index"),
    ("model-no-head-dim", edited(lambda d: d["model"].pop("head_dim")), "'model' must have exactly the keys"),
    ("model-bad-layers", edited(lambda d: d["model"].update(num_layers=-1)), "num_layers must be a positive int"),
    ("stale-split", edited(lambda d: d["split_ratios"][1].reverse()), r"split_ratios\[1\] .* does not match"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("write", "message"), [c[1:] for c in MALFORMED_FILES], ids=[c[0] for c in MALFORMED_FILES]
)
def test_malformed_files_are_refused(
    tmp_path: Path, write: Callable[[Path], None], message: str
) -> None:
    path = tmp_path / "broken-profile.json"
    write(path)
    with pytest.raises(ProfileError, match=message) as info:
        BudgetProfile.load(path)
    assert str(path) in str(info.value)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    with pytest.raises(ProfileError, match="does not exist") as info:
        BudgetProfile.load(path)
    assert str(path) in str(info.value) and "sgl_ragged.calibrate" in str(info.value)


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="is a directory"):
        BudgetProfile.load(tmp_path)


# ----- uniform profiles and specs --------------------------------------------------------


def test_uniform_profile() -> None:
    p = uniform_profile(0.3, num_layers=3, num_kv_heads=8)
    assert p.model is None and p.source == {"kind": "uniform", "rho": 0.3}
    assert p.budgets == ((0.3,) * 8,) * 3
    assert p.groups == ((tuple(range(8)),),) * 3 and p.heads_per_group == 8
    assert p.mean_budget == pytest.approx(0.3)
    assert uniform_profile(1.0, 1, 8, heads_per_group=2).groups == (
        ((0, 1), (2, 3), (4, 5), (6, 7)),
    )


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.01, math.nan, math.inf, True])
def test_uniform_profile_rejects_bad_ratio(ratio: float) -> None:
    with pytest.raises(ProfileError, match=r"uniform ratio must be in \(0, 1\]"):
        uniform_profile(ratio, 2, 4)


@pytest.mark.parametrize(
    ("spec", "ratio"), [("uniform:0.3", 0.3), ("uniform:1", 1.0), (" Uniform: 0.5 ", 0.5)]
)
def test_resolve_uniform_spec(spec: str, ratio: float) -> None:
    p = resolve_profile(spec, SHAPE)
    assert p.budgets == ((ratio,) * 4,) * 2
    assert p.heads_per_group == 4 and p.source["kind"] == "uniform"
    assert resolve_profile(spec, SHAPE, heads_per_group=1).groups == (((0,), (1,), (2,), (3,)),) * 2


@pytest.mark.parametrize(
    "spec",
    ["uniform", "uniform:", "uniform:abc", "uniform:0", "uniform:-0.3", "uniform:1.5",
     "uniform:nan", "uniform:inf", "uniform:0.3:0.4", "uniform:30%"],
)  # fmt: skip
def test_resolve_rejects_bad_uniform_spec(spec: str) -> None:
    with pytest.raises(ProfileError) as info:
        resolve_profile(spec, SHAPE)
    assert str(info.value) == f"expected uniform:<ratio in (0,1]>, got {spec!r}"


def test_resolve_profile_file(profile: BudgetProfile, profile_file: Path) -> None:
    assert resolve_profile(str(profile_file), SHAPE) == profile
    regrouped = resolve_profile(str(profile_file), SHAPE, heads_per_group=1)
    assert regrouped == profile.regrouped(1)


def test_resolve_profile_file_for_another_model(profile_file: Path) -> None:
    other = ModelShape("LlamaForCausalLM", 2, 8, 64)
    with pytest.raises(ProfileError, match="num_kv_heads: profile has 4, model has 8"):
        resolve_profile(str(profile_file), other)


def test_resolve_rejects_heads_per_group_not_dividing(profile_file: Path) -> None:
    for spec in ("uniform:0.3", str(profile_file)):
        with pytest.raises(ProfileError, match="heads_per_group=3 does not divide the 4 KV heads"):
            resolve_profile(spec, SHAPE, heads_per_group=3)


@pytest.mark.parametrize("spec", ["", "uniform.json", "calib_profiles/missing.json"])
def test_resolve_rejects_missing_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError, match="does not exist|empty profile spec"):
        resolve_profile(spec, SHAPE)
