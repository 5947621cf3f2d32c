"""Arithmetic of the accuracy benchmark (bench/accuracy_stats.py, accuracy_configs.py, accuracy_scoring.py): KL with a
rest bucket against brute force, standard errors, paired differences and their flags."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from bench.accuracy_configs import plan_configs, precision_configs
from bench.accuracy_scoring import comparisons
from bench.accuracy_stats import Diff, binomial_se, kl_topk, paired_diff
from sgl_ragged.stats import mean_se

P = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = np.array([0.30, 0.30, 0.10, 0.05, 0.20, 0.05])


def brute_force_kl(p: np.ndarray, q: np.ndarray, top: list[int]) -> float:
    """KL over the explicit distribution with every token outside `top` merged into one."""
    rest = [i for i in range(len(p)) if i not in top]
    pm = np.append(p[top], p[rest].sum())
    qm = np.append(q[top], q[rest].sum())
    keep = pm > 0
    return float(np.sum(pm[keep] * np.log(pm[keep] / qm[keep])))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_kl_topk_matches_merged_brute_force(k):
    top = list(np.argsort(-P)[:k])
    got = kl_topk(list(np.log(P[top])), list(np.log(Q[top])))
    assert got == pytest.approx(brute_force_kl(P, Q, top), rel=1e-12)
    assert got <= float(np.sum(P * np.log(P / Q))) + 1e-12  # merging never increases KL


def test_kl_topk_exact_with_whole_vocabulary_and_zero_for_equal():
    full = float(np.sum(P * np.log(P / Q)))
    assert kl_topk(list(np.log(P)), list(np.log(Q))) == pytest.approx(full, rel=1e-9)
    assert kl_topk(list(np.log(P[:3])), list(np.log(P[:3]))) == pytest.approx(0.0, abs=1e-15)


def test_kl_topk_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="equally long"):
        kl_topk([-1.0], [-1.0, -2.0])


def test_mean_se_matches_numpy():
    xs = [0.3, 0.1, 0.4, 0.15, 0.9]
    m = mean_se(xs)
    assert m.mean == pytest.approx(np.mean(xs))
    assert m.se == pytest.approx(np.std(xs, ddof=1) / math.sqrt(len(xs)))
    assert math.isnan(mean_se([1.0]).se) and math.isnan(mean_se([]).mean)


def test_binomial_se():
    b = binomial_se(3, 12)
    assert b.mean == 0.25 and b.se == pytest.approx(math.sqrt(0.25 * 0.75 / 12))
    assert binomial_se(0, 5).se == 0.0


def test_paired_diff_and_flags():
    a, b = [0.5, 0.7, 0.2, 0.9], [0.4, 0.5, 0.25, 0.6]
    d = paired_diff(a, b)
    diffs = np.subtract(a, b)
    assert d.mean == pytest.approx(diffs.mean())
    assert d.se == pytest.approx(diffs.std(ddof=1) / 2)
    assert d.z == pytest.approx(d.mean / d.se)
    assert d.exceeds_se and not d.exceeds_2se  # z = 1.67
    assert not Diff(0.05, 0.1, 4).exceeds_se and Diff(0.3, 0.1, 4).exceeds_2se
    assert Diff(0.0, 0.0, 4).z == 0.0 and Diff(0.1, 0.0, 4).z == math.inf
    with pytest.raises(ValueError, match="length"):
        paired_diff([1.0], [1.0, 2.0])


def test_plan_configs_lists_missing_profiles(tmp_path: Path):
    (tmp_path / "snapkv-rho0.5.json").write_text("{}")
    configs, missing = plan_configs([0.5, 0.3], ["snapkv"], tmp_path, 64)
    assert [c.name for c in configs] == ["full", "uniform@0.3", "dynamic-snapkv@0.3",
                                         "uniform@0.5", "static-snapkv@0.5", "dynamic-snapkv@0.5"]
    assert missing == [str(tmp_path / "snapkv-rho0.3.json")]
    assert configs[4].server_args()[-7:] == [str(tmp_path / "snapkv-rho0.5.json"),
                                             "--ragged-scorer", "snapkv", "--ragged-precision", "bf16",
                                             "--ragged-rotation", "none"]


def test_precision_configs_spend_rho_and_the_whole_page_budget(tmp_path: Path):
    from bench.accuracy_configs import config_bytes
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.profile import ModelShape, uniform_profile

    configs, _ = plan_configs([0.5, 0.3], ["snapkv"], tmp_path, 64, ["int4", "int8"])
    names = [c.name for c in configs]
    assert names[-6:] == ["int4-all@0.28125", "int4@0.3", "int4@0.5",
                          "int8-all@0.53125", "int8@0.3", "int8@0.5"]
    int4 = {c.name: c for c in configs}["int4@0.3"]
    assert int4.server_args()[-4:] == ["--ragged-precision", "int4", "--ragged-rotation", "none"]
    shape = ModelShape("LlamaForCausalLM", 30, 3, 64)
    for c in (c for c in configs if c.kind != "dynamic"):  # dynamic: rho of the entries
        layout = RaggedLayout.from_profile(uniform_profile(c.rho, 30, 3), 64, 64, 2, c.precision)
        assert config_bytes(c, shape) == pytest.approx(layout.retention)
        if c.kind == "tiers-all":  # every token at the low precision, nothing upgraded
            assert {(t.hi, t.lo) for layer in layout.tiers for t in layer} == {(0, 64)}



def test_precision_configs_size_the_whole_page_for_the_models_head_dim():
    """int4-all's budget buys a whole page of int4 with its per-channel key parameters, which
    weigh more at a small head_dim: 19 of 64 slots at D = 32, 18 at D = 64."""
    from sgl_ragged.precision import LOW_PRECISIONS

    for d, slots in ((32, 19), (64, 18)):
        config = precision_configs([0.5], ["int4"], "snapkv", d)[0]
        assert config.name == f"int4-all@{slots / 64}" and config.kind == "tiers-all"
        bf16_page = 2 * 64 * d * 2
        assert (slots - 1) * bf16_page / 64 < LOW_PRECISIONS["int4"].tier_bytes(64, 1, d) <= slots * bf16_page / 64


def test_stock_caches_are_stock_servers():
    """bench.accuracy --stock: stock SGLang (none of the plugin's flags) with SGLang's own
    --kv-cache-dtype on the CPU backend that stores it, at that cache's bytes; `auto` (the
    model's dtype) only for served configurations, where it measures the two backends' own
    difference."""
    from bench.accuracy_configs import STOCK, config_bytes, stock_configs
    from sgl_ragged.emulator.sglang_caches import stock_format
    from sgl_ragged.profile import ModelShape

    fp8, auto = stock_configs(["fp8_e4m3", "auto"], "snapkv", served=True)
    assert (fp8.name, auto.name, fp8.kind, auto.kind) == ("sglang-fp8_e4m3", "sglang-auto", STOCK, STOCK)
    # SGLang 0.5.23 refuses fp8_e4m3 on a CPU with any other backend than intel_amx
    assert fp8.server_args() == ["--attention-backend", "intel_amx", "--kv-cache-dtype", "fp8_e4m3"]
    assert auto.server_args() == ["--attention-backend", "torch_native", "--kv-cache-dtype", "auto"]
    shape = ModelShape("LlamaForCausalLM", 30, 3, 64)
    assert config_bytes(fp8, shape) == stock_format("fp8_e4m3").bytes_fraction(64) == pytest.approx(0.5, abs=0.01)
    assert config_bytes(auto, shape) == 1.0
    with pytest.raises(ValueError, match="only a served stock cache"):
        stock_configs(["auto"], "snapkv")


def test_comparisons_pair_static_with_dynamic_and_uniform(tmp_path: Path):
    (tmp_path / "snapkv-rho0.5.json").write_text("{}")
    configs, _ = plan_configs([0.5], ["snapkv"], tmp_path, 64)

    def recs(exact: list[bool], kl: list[float]) -> list[dict]:
        return [{"session": i, "turn": 0, "exact": e, "kl": k, "top1": [e, True]}
                for i, (e, k) in enumerate(zip(exact, kl, strict=True))]

    records = {"static-snapkv@0.5": recs([True, True, False], [0.1, 0.2, 0.3]),
               "dynamic-snapkv@0.5": recs([True, False, False], [0.1, 0.2, 0.3]),
               "uniform@0.5": recs([False, False, False], [0.5, 0.9, 0.7])}
    comps = {(c["a"], c["b"]): c for c in comparisons(configs, records)}
    vs_dyn = comps["static-snapkv@0.5", "dynamic-snapkv@0.5"]
    assert vs_dyn["kl_mean"] == pytest.approx(0.0) and not vs_dyn["kl_exceeds_se"]
    assert vs_dyn["exact_mean"] == pytest.approx(1 / 3)
    assert vs_dyn["top1_mean"] == pytest.approx(1 / 6)
    vs_uni = comps["static-snapkv@0.5", "uniform@0.5"]
    assert vs_uni["kl_mean"] == pytest.approx(-0.5) and vs_uni["kl_exceeds_2se"]
    assert len(comps) == 2


def test_mean_budget_profiles_join_as_equal_memory_configs(tmp_path: Path):
    for name in ("snapkv-rho0.5.json", "snapkv-mean-rho0.5.json"):
        (tmp_path / name).write_text("{}")
    configs, missing = plan_configs([0.5], ["snapkv"], tmp_path, 64)
    assert [c.name for c in configs] == ["full", "uniform@0.5", "static-snapkv@0.5",
                                         "static-mean-snapkv@0.5", "dynamic-snapkv@0.5"]
    assert not missing and configs[3].profile == str(tmp_path / "snapkv-mean-rho0.5.json")
    rec = [{"session": 0, "turn": 0, "exact": True, "kl": 0.1, "top1": [True]}]
    records = {c.name: rec for c in configs}
    pairs = {(c["a"], c["b"]) for c in comparisons(configs, records)}
    assert pairs == {("static-snapkv@0.5", "dynamic-snapkv@0.5"),
                     ("static-snapkv@0.5", "uniform@0.5"),
                     ("static-mean-snapkv@0.5", "uniform@0.5"),
                     ("static-mean-snapkv@0.5", "dynamic-snapkv@0.5"),
                     ("static-mean-snapkv@0.5", "static-snapkv@0.5")}


def test_other_budget_sources_join_as_equal_memory_configs(tmp_path: Path):
    for name in ("snapkv-mean-rho0.5.json", "kvcompose-snapkv-mean-rho0.5.json",
                 "kvcompose-snapkv-rho0.5.json", "baklava-snapkv-rho0.5.json"):
        (tmp_path / name).write_text("{}")
    configs, _ = plan_configs([0.5], ["snapkv"], tmp_path, 64)
    assert [c.name for c in configs] == ["full", "uniform@0.5", "static-mean-snapkv@0.5",
                                         "kvcompose-snapkv@0.5", "baklava-snapkv@0.5",
                                         "dynamic-snapkv@0.5"]
    assert configs[3].profile == str(tmp_path / "kvcompose-snapkv-mean-rho0.5.json")
    rec = [{"session": 0, "turn": 0, "exact": True, "kl": 0.1, "top1": [True]}]
    pairs = {(c["a"], c["b"]) for c in comparisons(configs, {c.name: rec for c in configs})}
    assert {("kvcompose-snapkv@0.5", "uniform@0.5"), ("kvcompose-snapkv@0.5", "static-mean-snapkv@0.5"),
            ("baklava-snapkv@0.5", "uniform@0.5"), ("baklava-snapkv@0.5", "static-mean-snapkv@0.5")} <= pairs


def test_quantized_high_tiers_pair_with_drop_and_int4_tiers(tmp_path: Path):
    configs, _ = plan_configs([0.2], ["snapkv"], tmp_path, 64, ["int4", "int8+int2"])
    rec = [{"session": 0, "turn": 0, "exact": True, "kl": 0.1, "top1": [True]}]
    pairs = {(c["a"], c["b"]) for c in comparisons(configs, {c.name: rec for c in configs})}
    assert {("int8+int2@0.2", "uniform@0.2"), ("int8+int2@0.2", "int4@0.2"),
            ("int4@0.2", "uniform@0.2")} <= pairs


def test_rotated_precisions_pair_with_their_unrotated_twins(tmp_path: Path):
    (tmp_path / "mixed-uniform-rho0.2.json").write_text("{}")
    precisions = ["int4", "int4r", "int8+int4r", "mixed", "mixedr"]
    configs, _ = plan_configs([0.2], ["snapkv"], tmp_path, 64, precisions)
    def recs(kl: list[float]) -> list[dict]:
        return [{"session": i, "turn": 0, "exact": True, "kl": k, "top1": [True]}
                for i, k in enumerate(kl)]

    records = {c.name: recs([0.3, 0.5]) for c in configs}
    records["int4r@0.2"] = recs([0.1, 0.2])
    comps = {(c["a"], c["b"]): c for c in comparisons(configs, records)}
    assert {("int4r@0.2", "int4@0.2"), ("mixedr@0.2", "mixed@0.2"),
            ("int4r-all@0.28125", "int4-all@0.28125")} <= comps.keys()
    assert comps["int4r@0.2", "int4@0.2"]["kl_mean"] == pytest.approx(-0.25)
    # no twin run (int8+int4 not asked for), no unrotated config paired with a rotated one
    assert not any(b == "int8+int4@0.2" or (a, b) == ("int4@0.2", "int4r@0.2") for a, b in comps)


def test_a_profile_file_is_one_config(tmp_path: Path):
    from bench.accuracy_configs import PROFILE, profile_config
    from sgl_ragged.profile import model_shape, uniform_profile

    shape = model_shape(os.environ["SGL_RAGGED_MODEL"]) if os.environ.get("SGL_RAGGED_MODEL") else None
    if shape is None:
        pytest.skip("needs SGL_RAGGED_MODEL (scripts/env.sh sets it)")
    path = tmp_path / "p.json"
    uniform_profile(0.2, shape.num_layers, shape.num_kv_heads).save(path)
    config = profile_config(f"perhead@0.2={path}=int8+int2", "snapkv", shape)
    assert (config.name, config.kind, config.profile, config.precision) == (
        "perhead@0.2", PROFILE, str(path), "int8+int2")
    assert config.server_args()[-6:] == ["--ragged-scorer", "snapkv", "--ragged-precision", "int8+int2",
                                         "--ragged-rotation", "none"]
    assert config.rho == 0.201  # 5 int8 + 59 int2 a page, as int8+int2@0.2
    assert profile_config(f"drop={path}", "snapkv", shape).precision == "bf16"
    with pytest.raises(ValueError, match="no profile file"):
        profile_config(f"x={tmp_path / 'none.json'}", "snapkv", shape)
