"""Calibration (sgl_ragged.calibrate): Eq. 3 retention and Spearman against brute force, samples,
and whole runs on a tiny random Llama and (if available) the default model."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sgl_ragged.budgets import split_map
from sgl_ragged.calibrate.pipeline import CalibrationConfig, calibrate
from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.emulator.runner import LayerQKV
from sgl_ragged.emulator.samples import build_samples
from sgl_ragged.profile import BudgetProfile, ModelShape, ProfileError, model_shape, resolve_profile
from sgl_ragged.scoring import SINK_TOKENS, SnapKVScorer
from sgl_ragged.sources import TangramSource
from sgl_ragged.sources.margin import sample_retention
from sgl_ragged.sources.statistics import (
    BUDGET_FLOOR,
    average_ranks,
    coverage,
    held_out_coverage,
    mean_matched_alpha,
    reserved_budgets,
    spearman,
)
from sgl_ragged.sources.writer import build_profile, output_paths

TINY_CHUNKING = ChunkingConfig(page_size=16, chunk_size=64, obs_window=8)



# ----- Eq. 3 retention against brute force ------------------------------------------------


def _brute_retention(layer: LayerQKV, cfg: ChunkingConfig, rho: float, kernel: int, scale: float) -> list[float]:
    """Per-head retention of one layer, from the definitions, with Python loops (float64)."""
    q, k = layer.q.double(), layer.k.double()
    t_len, h_q, _ = q.shape
    h_kv, group, p = k.shape[1], h_q // k.shape[1], cfg.page_size
    kept = [0] * h_kv
    for start in range(0, t_len, cfg.chunk_size):
        end = min(start + cfg.chunk_size, t_len)
        window = range(max(start, end - cfg.obs_window), end)
        attn = [[0.0] * (end - start) for _ in range(h_kv)]
        obs = [sum(1 for i in window if i >= t) for t in range(start, end)]
        for i in window:
            probs = [torch.softmax((k[: i + 1, hq // group] @ q[i, hq]) * scale, 0) for hq in range(h_q)]
            for h in range(h_kv):
                for t in range(start, end):
                    if t <= i:
                        attn[h][t - start] += max(float(probs[hq][t]) for hq in range(h * group, (h + 1) * group))
        mean = [[a / max(o, 1) for a, o in zip(row, obs, strict=True)] for row in attn]
        r = kernel // 2
        pooled = [[max(row[max(j - r, j - j % p): min(j + r + 1, j - j % p + p)]) for j in range(len(row))]
                  for row in mean]  # fmt: skip
        n = end - start
        sinks = [start + j < SINK_TOKENS for j in range(n)]
        budget = min(h_kv * n, max(math.ceil(rho * h_kv * n), sum(sinks) * h_kv))
        order = sorted(((h, j) for h in range(h_kv) for j in range(n)),
                       key=lambda hj: (not sinks[hj[1]], -pooled[hj[0]][hj[1]], hj[0], hj[1]))  # fmt: skip
        for h, _ in order[:budget]:
            kept[h] += 1
    return [x / t_len for x in kept]


@pytest.mark.parametrize(("kernel", "rho"), [(1, 0.3), (3, 0.5), (7, 0.2)])
def test_sample_retention_matches_brute_force(kernel: int, rho: float) -> None:
    gen = torch.Generator().manual_seed(kernel)
    t_len, h_q, h_kv, d = 48, 4, 2, 8
    layer = LayerQKV(*(torch.randn(t_len, h, d, generator=gen) * 2 for h in (h_q, h_kv, h_kv)))
    cfg = ChunkingConfig(page_size=8, chunk_size=16, obs_window=5)
    got = sample_retention([layer], [SnapKVScorer(kernel)], [rho], cfg, scale=d**-0.5,
                           selector=TangramSource())
    assert got.shape == (1, 1, 1, h_kv)
    want = _brute_retention(layer, cfg, rho, kernel, d**-0.5)
    assert got[0, 0, 0].tolist() == pytest.approx(want, abs=1e-12)


def test_retention_keeps_sinks_and_meets_rho() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = LayerQKV(*(torch.randn(64, h, 8, generator=gen) for h in (4, 2, 2)))
    cfg = ChunkingConfig(page_size=16, chunk_size=32, obs_window=4)
    got = sample_retention([layer, layer], [SnapKVScorer()], [0.25, 1.0], cfg, scale=8**-0.5,
                           selector=TangramSource())
    assert got.shape == (1, 2, 2, 2)
    assert got[0, 0].mean().item() == pytest.approx(0.25)  # ceil(0.25 * 2 * 32) = 16 per chunk
    assert (got[0, 1] == 1.0).all()
    assert (got[0, 0] * 64 >= SINK_TOKENS).all()  # every head keeps the sinks


# ----- Spearman and coverage against brute force ------------------------------------------


def _brute_ranks(x: list[float]) -> list[float]:
    return [1 + sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x]


def _pearson(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else math.nan


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 9).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.1, 0.2, 0.3, 0.5, 0.9]), min_size=n, max_size=n),
    st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=n, max_size=n))))  # fmt: skip
def test_spearman_matches_brute_force(xy: tuple[list[float], list[float]]) -> None:
    x, y = xy
    assert average_ranks(np.array(x)).tolist() == _brute_ranks(x)
    want = _pearson(_brute_ranks(x), _brute_ranks(y))
    got = spearman(x, y)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-12)


def test_spearman_without_ties_is_the_textbook_formula() -> None:
    x, y = [0.3, 0.1, 0.7, 0.5, 0.2], [0.2, 0.4, 0.9, 0.1, 0.3]
    d2 = sum((a - b) ** 2 for a, b in zip(_brute_ranks(x), _brute_ranks(y), strict=True))
    assert spearman(x, y) == pytest.approx(1 - 6 * d2 / (5 * (25 - 1)))
    assert spearman(x, x) == pytest.approx(1.0) and spearman(x, [-v for v in x]) == pytest.approx(-1.0)


def test_coverage_counts_overflows() -> None:
    retention = np.array([[[0.2, 0.5]], [[0.4, 0.5]], [[0.3, 0.7]]])  # [S=3, L=1, H=2]
    cov = coverage(retention, np.array([[0.35, 0.6]]), ["a", "b", "a"])
    # The statistics are stored rounded to 4 decimals.
    assert cov["overall"] == round(4 / 6, 4) and cov["by_task"] == {"a": 0.75, "b": 0.5}
    assert cov["worst_head"] == {"layer": 0, "head": 0, "coverage": round(2 / 3, 4)}
    assert cov["max_overflow"] == 0.1 and cov["samples_fully_covered"] == round(1 / 3, 4)
    assert held_out_coverage(retention[:1], 2.0) is None
    assert held_out_coverage(retention, 0.0) == 0.5  # B from samples 0, 2 = mean; sample 1 vs it


# ----- samples and configuration ----------------------------------------------------------


def test_samples_are_exact_deterministic_and_round_robin(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    first = build_samples(tok, 6, seed=3, min_tokens=100, max_tokens=300, page_size=16)
    again = build_samples(tok, 6, seed=3, min_tokens=100, max_tokens=300, page_size=16)
    other = build_samples(tok, 6, seed=4, min_tokens=100, max_tokens=300, page_size=16)
    assert [s.task for s in first] == ["summary", "code", "retrieval"] * 2
    assert all(s.num_tokens % 16 == 0 and 96 <= s.num_tokens <= 300 for s in first)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, other, strict=True))
    text = tok.decode(first[2].input_ids)
    assert "Question: In the registry above, what is the value for the key" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rhos": (0.0,)}, r"ratio must be in \(0, 1\]"),
        ({"scorers": ("nope",)}, "unknown scorer 'nope'"),
        ({"samples": 0}, "--samples must be >= 1"),
        ({"alpha": -1.0}, "--alpha must be"),
        ({"budget_mode": "median"}, "--budget-mode must be one of margin, mean"),
        ({"rhos": (0.3, 0.5)}, r"several ratios need \{rho\}"),
        ({"min_tokens": 8}, "need page size <= --min-tokens"),
    ],
)
def test_config_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(model_path="m", output="out.json", **kwargs)


def test_chunking_is_validated() -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        ChunkingConfig(page_size=64, chunk_size=100)
    with pytest.raises(ValueError, match="smaller than the 4 sink tokens"):
        ChunkingConfig(page_size=2, chunk_size=64)
    assert ChunkingConfig(16, 64).chunks(160) == [(0, 64), (64, 128), (128, 160)]


def test_output_patterns() -> None:
    paths = output_paths("d/{scorer}-rho{rho}.json", ["snapkv", "h2o"], [0.3, 0.5])
    assert paths["h2o", 0.5] == Path("d/h2o-rho0.5.json") and len(paths) == 4
    with pytest.raises(ValueError, match="only {scorer} and {rho}"):
        output_paths("d/{model}.json", ["snapkv"], [0.3])


# ----- mean budget mode (docs/calibration.md) -----------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.05, 0.9))
@example(878, 0.15625)  # a head with sigma ~1e-3 puts the crossing at alpha ~ -299
def test_mean_matched_alpha_matches_a_brute_force_scan(seed: int, rho: float) -> None:
    """Eq. 5's mean budget, scanned over a fine grid of margins, crosses rho where the
    bisection says (clipping at 1 and at the floor included)."""
    rng = np.random.default_rng(seed)
    mu = rng.uniform(0.0, 1.0, (3, 4))
    sigma = rng.uniform(0.0, 0.3, (3, 4)) * (rng.random((3, 4)) > 0.2)  # some never vary
    reach = (reserved_budgets(mu, sigma, -1e9).mean(), reserved_budgets(mu, sigma, 1e9).mean())
    if not reach[0] < rho < reach[1]:
        with pytest.raises(ValueError, match="no margin gives a mean budget"):
            mean_matched_alpha(mu, sigma, rho)
        return
    alpha = mean_matched_alpha(mu, sigma, rho)
    assert reserved_budgets(mu, sigma, alpha).mean() == pytest.approx(rho, abs=1e-9)
    # The mean only moves between the margins where some varying head leaves the floor or
    # reaches 1 (a head with a tiny sigma puts them far out): scan that whole span.
    varying = sigma > 0
    ends = np.concatenate([(BUDGET_FLOOR - mu[varying]) / sigma[varying], (1.0 - mu[varying]) / sigma[varying]])
    grid, step = np.linspace(ends.min(), ends.max(), 400_001, retstep=True)
    means = np.clip(mu[None] + grid[:, None, None] * sigma[None], BUDGET_FLOOR, 1.0).mean((1, 2))
    first = grid[np.argmax(means >= rho - 1e-12)]  # the smallest scanned margin that reaches rho
    slack = 1e-9 * max(1.0, abs(first))
    assert first - step - slack <= alpha <= first + slack


def test_mean_mode_profile_spends_rho_on_average() -> None:
    rng = np.random.default_rng(3)
    retention = np.clip(rng.normal(0.3, 0.1, (8, 2, 4)), 0.0, 1.0)  # [S, L, H]
    shape = ModelShape("LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_dim=16)
    args = (shape, retention, ["summary"] * 8, [256] * 8, 2.0, 2, {"kind": "calibrated", "rho": 0.3}, {})
    margin = build_profile(*args)
    mean = build_profile(*args, budget_mode="mean")
    assert margin.mean_budget > 0.33 and margin.source["budget_mode"] == "margin"
    assert mean.mean_budget == pytest.approx(0.3, abs=1e-5)
    assert mean.source["budget_mode"] == "mean" and mean.source["alpha"] != 2.0
    with pytest.raises(ValueError, match="budget mode must be one of"):
        build_profile(*args, budget_mode="median")


# ----- whole runs -------------------------------------------------------------------------


def test_calibration_of_tiny_llama(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = CalibrationConfig(
        model_path=str(tiny_llama), output=str(tmp_path / "{scorer}-rho{rho}.json"),
        rhos=(0.5, 0.3), samples=4, alpha=2.0, heads_per_group=1, chunking=TINY_CHUNKING,
        min_tokens=96, max_tokens=160, seed=0,
    )  # fmt: skip
    paths = calibrate(cfg, progress=False)
    assert sorted(p.name for p in paths) == ["snapkv-rho0.3.json", "snapkv-rho0.5.json"]
    shape = model_shape(str(tiny_llama))
    for rho in (0.5, 0.3):
        profile = resolve_profile(str(tmp_path / f"snapkv-rho{rho:g}.json"), shape)
        assert all(0.0 < b <= 1.0 for row in profile.budgets for b in row)
        # Eq. 3 keeps ceil(rho * H * n) of every chunk's H * n tokens: the mean retention
        # before the margin is rho plus at most one token per chunk (n >= one page of 16).
        mean_mu = float(np.mean(profile.mu))
        assert rho <= mean_mu + 1e-6 <= rho + 1 / (2 * 16) + 1e-6
        assert profile.mean_budget >= mean_mu - 1e-6
        for layer, groups in zip(profile.budgets, profile.groups, strict=True):
            assert sorted(h for g in groups for h in g) == [0, 1]
            assert list(groups) == sorted(groups, key=lambda g: max(layer[h] for h in g))
        assert all(abs(sum(row) - 1.0) < 1e-6 for row in profile.split_ratios)
        assert all(abs(sum(row) - 16) <= len(row) for row in split_map(profile.budgets, profile.groups, 16))
        samples = profile.sample_retention
        assert samples is not None and samples.tasks == ("summary", "code", "retrieval", "summary")
        assert np.asarray(samples.retention).shape == (4, 2, 2)
        assert np.allclose(np.asarray(samples.retention).mean(0), profile.mu, atol=1e-3)
        assert profile.source["rho"] == rho and profile.source["samples"] == 4
        assert {"rank_stability", "coverage", "run"} <= profile.stats.keys()
    other = model_shape(str(tiny_llama)).__class__("LlamaForCausalLM", 3, 2, 16)
    with pytest.raises(ProfileError, match="num_layers: profile has 2, model has 3"):
        resolve_profile(str(paths[0]), other)


def test_calibration_of_default_model(tmp_path: Path) -> None:
    model = os.environ.get("RAGGED_MODEL")
    if not model or not Path(model, "config.json").is_file():
        pytest.skip("RAGGED_MODEL does not name a checkpoint (scripts/test.sh exports it)")
    cfg = CalibrationConfig(
        model_path=model, output=str(tmp_path / "p.json"), scorers=("snapkv",), rhos=(0.3,),
        samples=2, chunking=ChunkingConfig(64, 128, 32), min_tokens=256, max_tokens=256,
    )  # fmt: skip
    (path,) = calibrate(cfg, progress=False)
    profile = BudgetProfile.load(path)
    assert (profile.num_layers, profile.num_kv_heads) == (30, 3)
    assert float(np.mean(profile.mu)) == pytest.approx(0.3, abs=1 / (3 * 128))
