"""KVCompose and BaKlaVa budget sources, and the compressed-loss forward, against brute force."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ragged.calibrate.pipeline import CalibrationConfig, calibrate
from sgl_ragged.cli.summary import describe
from sgl_ragged.emulator.chunks import ChunkingConfig, chunk_page_stats
from sgl_ragged.emulator.compressed import (
    CompressedLoss,
    FlatTopSelection,
    SlotSelection,
    attention_mask,
    head_slots,
    sealed_keep,
    token_kl,
)
from sgl_ragged.emulator.runner import CaptureRunner, LayerQKV
from sgl_ragged.emulator.samples import build_samples
from sgl_ragged.profile import BudgetProfile, model_shape, resolve_profile
from sgl_ragged.scoring import SINK_TOKENS, make_scorer
from sgl_ragged.sources import BaKlaVaSource, KVComposeSource
from sgl_ragged.sources.baklava import baklava_budgets, baklava_grid, head_importance
from sgl_ragged.sources.kvcompose import composite_scores, layer_kept_counts
from sgl_ragged.sources.margin import sample_retention

TINY = ChunkingConfig(page_size=16, chunk_size=32, obs_window=8)



def _random_layer(gen: torch.Generator, tokens: int, h_q: int = 4, h_kv: int = 2, dim: int = 8) -> LayerQKV:
    return LayerQKV(*(torch.randn(tokens, h, dim, generator=gen) for h in (h_q, h_kv, h_kv)))


# ----- KVCompose ----------------------------------------------------------------------------


def _brute_composite(scores: torch.Tensor, start: int) -> list[float]:
    """Eq. 16-19 with Python loops: per head, token score + mean over heads, sinks first."""
    n, h, p = scores.shape
    per_head = []
    for head in range(h):
        values = []
        for page in range(n):
            for off in range(p):
                pos = start + page * p + off
                mean = sum(float(scores[page, i, off]) for i in range(h)) / h
                value = math.inf if pos < SINK_TOKENS else float(scores[page, head, off]) + mean
                values.append(value)
        per_head.append(sorted(values, reverse=True))
    return [sum(per_head[head][k] for head in range(h)) / h for k in range(n * p)]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 16, 48]))
def test_composite_scores_match_brute_force(seed: int, start: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 3, 16, generator=gen)
    from sgl_ragged.scoring.select import sink_mask

    sinks = sink_mask(start + 16 * torch.arange(2), 16)
    got = composite_scores(scores, sinks).tolist()
    want = _brute_composite(scores, start)
    assert got == pytest.approx(want, rel=1e-5)
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))  # descending


def _brute_layer_counts(composite: list[list[float]], rho: float) -> list[int]:
    """Eq. 20-22: the top ceil(rho * L * T) of the pooled (layer, rank) scores, ties by index."""
    layers, tokens = len(composite), len(composite[0])
    pool = [(-v, li * tokens + k) for li, row in enumerate(composite) for k, v in enumerate(row)]
    forced = sum(1 for row in composite for v in row if math.isinf(v))
    budget = min(layers * tokens, max(math.ceil(rho * layers * tokens), forced))
    counts = [0] * layers
    for _, flat in sorted(pool)[:budget]:
        counts[flat // tokens] += 1
    return counts


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.05, 1.0), st.booleans(), st.booleans())
def test_layer_kept_counts_match_brute_force(seed: int, rho: float, sinks: bool, ties: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.rand(4, 32, generator=gen)
    if ties:
        rows = (rows * 4).floor()  # many equal scores across layers
    if sinks:
        rows[:, :4] = math.inf
    composite = [torch.sort(r, descending=True).values for r in rows]
    got = layer_kept_counts(composite, [rho, 1.0])
    assert got[0].tolist() == _brute_layer_counts([c.tolist() for c in composite], rho)
    assert got[1].tolist() == [32] * 4


def test_kvcompose_retention_is_per_layer_and_spends_rho() -> None:
    gen = torch.Generator().manual_seed(0)
    cfg = ChunkingConfig(page_size=16, chunk_size=64, obs_window=8)
    layers = [_random_layer(gen, 160) for _ in range(3)]
    scorer = make_scorer("snapkv")
    got = sample_retention(layers, [scorer], [0.3, 0.6], cfg, 0.35, KVComposeSource())[0]  # [R, L, H]
    assert torch.equal(got[:, :, 0], got[:, :, 1])  # every head of a layer keeps the same share
    want = torch.zeros(2, 3)
    for start, end in cfg.chunks(160):
        composite = []
        for layer in layers:
            scores = scorer.page_scores(chunk_page_stats(layer, start, end, cfg, 0.35))
            composite.append(_brute_composite(scores, start))
        for ri, rho in enumerate((0.3, 0.6)):
            want[ri] += torch.tensor(_brute_layer_counts(composite, rho), dtype=torch.float64)
    assert torch.allclose(got[:, :, 0], want.double() / 160)
    # Over a whole sample the layers keep rho of the tokens (plus rounding per chunk).
    assert got[0].mean() == pytest.approx(0.3, abs=3 / (3 * 160))
    assert not torch.allclose(got[0, :, 0], got[0, 0, 0].expand(3))  # layers differ
    with pytest.raises(ValueError, match="margin sources"):
        sample_retention(layers, [scorer], [0.3], cfg, 0.35, BaKlaVaSource())


# ----- BaKlaVa ------------------------------------------------------------------------------


def _brute_importance(layer: LayerQKV, scale: float) -> list[float]:
    t, h_q, _ = layer.q.shape
    h_kv = layer.k.shape[1]
    group = h_q // h_kv
    sims = []
    for hq in range(h_q):
        kv = hq // group
        cos = []
        for i in range(t):
            logits = [float(layer.q[i, hq] @ layer.k[j, kv]) * scale for j in range(i + 1)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            out = sum(w / total * layer.v[j, kv].double() for j, w in enumerate(weights))
            v = layer.v[i, kv].double()
            cos.append(float(out @ v / (out.norm() * v.norm())))
        sims.append((sum(cos) / t + 1) / 2)
    return [1 - sum(sims[h * group : (h + 1) * group]) / group for h in range(h_kv)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_head_importance_matches_brute_force(seed: int) -> None:
    layer = _random_layer(torch.Generator().manual_seed(seed), 12)
    got = head_importance(layer, 0.4).tolist()
    assert got == pytest.approx(_brute_importance(layer, 0.4), abs=1e-5)
    assert all(0.0 <= x <= 1.0 for x in got)


def test_attention_that_copies_its_value_is_unimportant() -> None:
    """A head whose tokens attend only to themselves outputs v_i: similarity 1, importance 0."""
    q = torch.eye(8)[:, None, :] * 1e4  # q_i . k_j is huge only for j == i
    layer = LayerQKV(q, torch.eye(8)[:, None, :], torch.randn(8, 1, 8))
    assert head_importance(layer, 1.0).tolist() == pytest.approx([0.0], abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4), min_size=1, max_size=5),
    st.floats(0.05, 0.6), st.floats(0.0, 0.9), st.floats(0.0, 1.0),
)  # fmt: skip
def test_baklava_budgets_follow_algorithm_2(importance: list[list[float]], rho: float,
                                            r: float, t: float) -> None:  # fmt: skip
    got = baklava_budgets(np.array(importance), rho, r, t)
    for row, budgets in zip(importance, got, strict=True):
        low = [h for h in range(4) if row[h] < t]
        n = len(low)
        if n in (0, 4):
            assert budgets.tolist() == pytest.approx([rho] * 4)
            continue
        raised = sorted((h for h in range(4) if h not in low), key=lambda h: (-row[h], h))[: min(n, 4 - n)]
        for h in range(4):
            if h in low:
                want = rho * (1 - r)
            elif h in raised:
                want = min(1.0, rho + n * r * rho / len(raised))
            else:
                want = rho
            assert budgets[h] == pytest.approx(want)
        if all(b < 1.0 for b in budgets):
            assert budgets.sum() == pytest.approx(4 * rho)  # the layer's total is conserved


def test_baklava_grid_and_validation() -> None:
    importance = np.array([[0.1, 0.2], [0.3, 0.4]])
    grid = baklava_grid(importance, [0.0, 0.5], [0.0, 0.5, 1.0])
    assert grid == [(0.0, 0.0), (0.5, 0.1), (0.5, 0.25), (0.5, 0.4)]
    with pytest.raises(ValueError, match="reduction r must be in"):
        baklava_budgets(importance, 0.3, 1.0, 0.2)
    with pytest.raises(ValueError, match="rho must be in"):
        baklava_budgets(importance, 0.0, 0.5, 0.2)


# ----- compressed loss ----------------------------------------------------------------------


def test_head_slots_follow_the_group_rows() -> None:
    budgets = [[0.1, 0.5, 0.3, 1.0]]
    groups = [((0, 2), (1, 3))]
    assert head_slots(budgets, groups, 16) == [[5, 16, 5, 16]]  # ceil(0.3 * 16), group max
    assert head_slots([[0.01, 0.01]], [((0,), (1,))], 16) == [[4, 4]]  # at least the sinks


def _brute_keep(layer: LayerQKV, slots: list[int], cfg: ChunkingConfig, scale: float) -> torch.Tensor:
    scorer = make_scorer("snapkv")
    t, h_kv = layer.k.shape[:2]
    keep = torch.ones(h_kv, t, dtype=torch.bool)
    chunks = cfg.chunks(t)
    for start, end in chunks[:-1]:
        scores = scorer.page_scores(chunk_page_stats(layer, start, end, cfg, scale))
        for page in range(scores.shape[0]):
            for h in range(h_kv):
                base = start + page * cfg.page_size
                ranked = sorted(range(cfg.page_size), key=lambda o: (
                    0 if base + o < SINK_TOKENS else 1, -float(scores[page, h, o]), o))  # fmt: skip
                for o in range(cfg.page_size):
                    keep[h, base + o] = o in ranked[: slots[h]]
    return keep


@pytest.mark.parametrize("seed", [0, 1])
def test_sealed_keep_and_mask_match_brute_force(seed: int) -> None:
    layer = _random_layer(torch.Generator().manual_seed(seed), 80)
    slots = [5, 11]
    keep = sealed_keep(layer, 0, SlotSelection([slots]), make_scorer("snapkv"), TINY, 0.35)
    assert torch.equal(keep, _brute_keep(layer, slots, TINY, 0.35))
    assert keep[:, 64:].all() and keep[:, :SINK_TOKENS].all()
    assert keep[0, :64].sum() == 4 * 5 and keep[1, :64].sum() == 4 * 11
    mask = attention_mask(keep, TINY)
    for h in range(2):
        for i in range(80):
            for j in range(80):
                want = j <= i and (j // 32 == i // 32 or bool(keep[h, j]))
                assert bool(mask[h, i, j]) == want


def test_compressed_attention_matches_per_query_softmax(tiny_llama: Path) -> None:
    """The attention function CompressedLoss installs equals, per (head, query), a softmax over
    exactly the keys the mask leaves (computed with loops)."""
    runner = CaptureRunner(str(tiny_llama))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 64, 16, generator=gen), torch.randn(2, 64, 16, generator=gen), torch.randn(2, 64, 16, generator=gen)
    slots = [[4, 9], [16, 16]]
    out = loss._attention(SlotSelection(slots))(0, q, k, v)
    layer = LayerQKV(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    keep = _brute_keep(layer, slots[0], TINY, runner.scale)
    for hq in range(4):
        h = hq // 2
        for i in range(64):
            seen = [j for j in range(i + 1) if j // 32 == i // 32 or keep[h, j]]
            w = torch.softmax(torch.stack([q[hq, i] @ k[h, j] for j in seen]) * runner.scale, 0)
            want = sum(wj * v[h, j] for wj, j in zip(w, seen, strict=True))
            assert torch.allclose(out[hq, i], want, atol=1e-5)


# ----- whole runs -------------------------------------------------------------------------


def test_kvcompose_calibration(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = CalibrationConfig(
        model_path=str(tiny_llama), output=str(tmp_path / "kvc-rho{rho}.json"), rhos=(0.5, 0.3),
        samples=3, heads_per_group=2, source="kvcompose", budget_mode="mean",
        chunking=TINY, min_tokens=128, max_tokens=160,
    )  # fmt: skip
    paths = calibrate(cfg, progress=False)
    for rho, path in zip((0.5, 0.3), paths, strict=True):
        profile = resolve_profile(str(path), model_shape(str(tiny_llama)))
        assert profile.source["method"] == "kvcompose" and "KVCompose" in profile.source["selection"]
        assert all(len(set(row)) == 1 for row in profile.budgets)  # uniform within a layer
        assert profile.heads_per_group == 2
        assert profile.mean_budget == pytest.approx(rho, abs=1e-5)
        assert "kvcompose budgets" in describe(profile, path.name)


def test_baklava_calibration(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = CalibrationConfig(
        model_path=str(tiny_llama), output=str(tmp_path / "bak-rho{rho}.json"), rhos=(0.5,),
        samples=2, source="baklava",
        source_options={"eval_samples": 1, "reductions": (0.5,), "quantiles": (0.5,)},
        chunking=TINY, min_tokens=128, max_tokens=128,
    )  # fmt: skip
    (path,) = calibrate(cfg, progress=False)
    profile = BudgetProfile.load(path)
    search = profile.stats["baklava"]["search"]
    assert [(row["reduction"], row["threshold"]) for row in search][0] == (0.0, 0.0)
    assert len(search) == 2
    best = min(search, key=lambda row: row["nll"])
    assert (profile.source["reduction"], profile.source["threshold"]) == (best["reduction"], best["threshold"])
    importance = np.array(profile.stats["baklava"]["importance"])
    want = baklava_budgets(importance, 0.5, best["reduction"], best["threshold"])
    assert np.allclose(profile.budgets, want, atol=1e-5)
    assert profile.source["kind"] == "baklava" and profile.mean_budget == pytest.approx(0.5, abs=1e-5)
    # The searched loss is the compressed loss of those budgets on the held-out sample.
    runner = CaptureRunner(str(tiny_llama))
    (held_out,) = build_samples(runner.tokenizer, 1, 1, 128, 128, 16)
    slots = head_slots(profile.budgets, profile.groups, 16)
    nll = CompressedLoss(runner, make_scorer("snapkv"), TINY).token_nll(held_out.input_ids, SlotSelection(slots))
    assert float(nll.mean()) == pytest.approx(best["nll"], abs=1e-5)
    text = describe(profile, path.name)
    assert "BaKlaVa search" in text and "<- chosen" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "snapkv"}, "--source must be one of"),
        ({"source": "baklava", "budget_mode": "mean"}, "--budget-mode applies to"),
        ({"source": "baklava", "source_options": {"eval_samples": 0}}, "--eval-samples must be >= 1"),
        ({"source": "baklava", "source_options": {"reductions": (1.0,)}}, "--baklava-reductions must be in"),
        ({"source": "baklava", "source_options": {"quantiles": (1.5,)}}, "--baklava-quantiles must be in"),
        ({"source": "tangram", "source_options": {"eval_samples": 1}},
         "--source tangram takes no option eval_samples"),
        ({"source": "baklava", "min_tokens": 512, "max_tokens": 600}, "must exceed --chunk-size"),
    ],
)
def test_source_options_are_validated(kwargs: dict, message: str) -> None:
    base = {"model_path": "m", "output": "o.json", "min_tokens": 1024, "max_tokens": 1536}
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(**{**base, **kwargs})


def test_dynamic_selection_spends_rho_of_each_sealed_chunk() -> None:
    layer = _random_layer(torch.Generator().manual_seed(5), 96)
    keep = sealed_keep(layer, 0, FlatTopSelection(0.3), make_scorer("snapkv"), TINY, 0.35)
    assert keep[:, 64:].all()  # the last chunk is never sealed before its own queries
    for start in (0, 32):
        assert int(keep[:, start : start + 32].sum()) == math.ceil(0.3 * 2 * 32)
    assert keep[:, :SINK_TOKENS].all()


def test_token_kl_matches_the_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(3, 7, generator=gen), -1)
    b = torch.log_softmax(torch.randn(3, 7, generator=gen), -1)
    want = [sum(math.exp(float(a[t, v])) * float(a[t, v] - b[t, v]) for v in range(7)) for t in range(3)]
    assert token_kl(a, b).tolist() == pytest.approx(want, rel=1e-5)
    assert token_kl(a, a).abs().max() < 1e-7


def test_calibrate_cli_names_and_groups_by_source(tiny_llama: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from sgl_ragged.calibrate.cli import main

    monkeypatch.chdir(tmp_path)
    small = ["--rho", "0.5", "--samples", "2", "--page-size", "16", "--chunk-size", "32",
             "--obs-window", "8", "--min-tokens", "128", "--max-tokens", "128", "--quiet"]  # fmt: skip
    assert main([str(tiny_llama), "--source", "kvcompose", *small]) == 0
    path = Path("calib_profiles", tiny_llama.name.lower(), "kvcompose-snapkv-rho0.5.json")
    assert capsys.readouterr().out.split() == [str(path)]
    assert BudgetProfile.load(path).heads_per_group == 2  # kvcompose: all KV heads of a layer
    assert main([str(tiny_llama), "--source", "baklava", "--budget-mode", "mean", *small]) == 2
    assert "--budget-mode applies to tangram and kvcompose" in capsys.readouterr().err
    assert main([str(tmp_path / "no-model"), "--source", "kvcompose", *small]) == 2
    assert "sgl-ragged-calibrate: error:" in capsys.readouterr().err
