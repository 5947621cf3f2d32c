"""Every registered scorer against a plain-loop version, the flag's validation, and serving.

The serving test drives the torch reference through a prefill chunk and decode steps with each
scorer: the query statistics a page carries when it is sealed must be exactly the sums over the
window queries that saw it, and attention must still equal dense attention over the kept tokens.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sgl_ragged.config import RaggedConfig
from sgl_ragged.scoring import (
    SCORERS,
    ExpectedAttentionScorer,
    H2OScorer,
    KeyDiffScorer,
    PageStats,
    Scorer,
    StreamingScorer,
    make_scorer,
)
from tests.unit import test_ragged_attention as ragged

# ---- random page statistics ------------------------------------------------------------------


def _random_stats(seed: int, n: int, h: int, p: int, d: int, unseen: bool = False) -> PageStats:
    """N pages of random statistics; q_sum/q_sq_sum come from actual random query sets, and with
    `unseen` the first page has no observing query (zero sums, zero count)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 6, (n,), generator=g)
    if unseen:
        counts[0] = 0
    q_sum, q_sq = torch.zeros(n, h, d), torch.zeros(n, h, d)
    for i in range(n):
        qs = torch.randn(int(counts[i]), h, d, generator=g) * 2
        q_sum[i], q_sq[i] = qs.sum(0), qs.square().sum(0)
    return PageStats(
        attn_sum=torch.rand(n, h, p, generator=g) * 3,
        obs_count=torch.randint(0, 5, (n, p), generator=g).float(),
        keys=torch.randn(n, p, h, d, generator=g),
        values=torch.randn(n, p, h, d, generator=g),
        q_sum=q_sum,
        q_sq_sum=q_sq,
        q_count=counts.float(),
        scale=d**-0.5,
    )


_SHAPES = st.tuples(
    st.integers(0, 2**31 - 1),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(2, 9),
    st.integers(1, 6),
)


def _l(x: torch.Tensor) -> list:
    return x.tolist()


# ---- brute-force versions (plain Python loops) ------------------------------------------------


def _brute_expected_attention(s: PageStats, eps: float) -> list:
    n, h, p = s.attn_sum.shape
    d = s.keys.shape[-1]
    keys, values = _l(s.keys), _l(s.values)
    out = []
    for i in range(n):
        cnt = float(s.q_count[i])
        page = []
        for hh in range(h):
            if cnt > 0:
                mu = [float(s.q_sum[i, hh, j]) / cnt for j in range(d)]
                var = [max(0.0, float(s.q_sq_sum[i, hh, j]) / cnt - mu[j] ** 2) for j in range(d)]
            else:
                mu, var = [0.0] * d, [0.0] * d
            logits = []
            for t in range(p):
                k = keys[i][t][hh]
                dot = sum(mu[j] * k[j] for j in range(d))
                quad = sum(var[j] * k[j] ** 2 for j in range(d))
                logits.append(s.scale * dot + 0.5 * s.scale**2 * quad)
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            norms = [math.sqrt(sum(v * v for v in values[i][t][hh])) for t in range(p)]
            page.append([(e[t] / sum(e) + eps) * norms[t] for t in range(p)])
        out.append(page)
    return out


def _brute_keydiff(s: PageStats) -> list:
    n, h, p = s.attn_sum.shape
    keys = _l(s.keys)

    def unit(v: list[float]) -> list[float]:
        norm = math.sqrt(sum(x * x for x in v))
        return [x / max(norm, 1e-12) for x in v]

    out = []
    for i in range(n):
        page = []
        for hh in range(h):
            units = [unit(keys[i][t][hh]) for t in range(p)]
            anchor = unit([sum(u[j] for u in units) / p for j in range(len(units[0]))])
            page.append([-sum(a * b for a, b in zip(u, anchor, strict=True)) for u in units])
        out.append(page)
    return out


def _brute_h2o(s: PageStats) -> list:
    return [[list(row) for row in page] for page in _l(s.attn_sum)]


def _brute_streaming(s: PageStats) -> list:
    n, h, p = s.attn_sum.shape
    return [[[(t + 1) / p for t in range(p)] for _ in range(h)] for _ in range(n)]


# ---- scorers vs brute force ---------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(_SHAPES, st.booleans())
def test_expected_attention_matches_brute_force(shape, unseen):
    stats = _random_stats(*shape, unseen=unseen)
    got = ExpectedAttentionScorer(epsilon=0.01).page_scores(stats)
    torch.testing.assert_close(
        got, torch.tensor(_brute_expected_attention(stats, 0.01)), rtol=1e-4, atol=1e-5
    )


@settings(max_examples=40, deadline=None)
@given(_SHAPES)
@example((0, 3, 3, 2, 2))  # a near-cancelling page (failed at atol 1e-5 in session 8)
def test_keydiff_matches_brute_force(shape):
    stats = _random_stats(*shape)
    # The anchor is the normalized mean of a page's unit keys: float32 rounding of that mean
    # (~1e-7) grows by 1 / |mean|, which is small when a few keys nearly cancel (seed 0 with
    # 2 keys of 2 channels: |mean| ~ 0.005). The brute force runs in float64.
    unit = torch.nn.functional.normalize(stats.keys.double(), dim=-1)
    smallest_mean = unit.mean(dim=1).norm(dim=-1).min().item()
    torch.testing.assert_close(
        KeyDiffScorer().page_scores(stats),
        torch.tensor(_brute_keydiff(stats)),
        rtol=1e-4,
        atol=max(1e-5, 5e-7 / max(smallest_mean, 1e-12)),
    )


@settings(max_examples=20, deadline=None)
@given(_SHAPES)
def test_h2o_and_streaming_match_brute_force(shape):
    stats = _random_stats(*shape)
    torch.testing.assert_close(H2OScorer().page_scores(stats), torch.tensor(_brute_h2o(stats)))
    torch.testing.assert_close(
        StreamingScorer().page_scores(stats), torch.tensor(_brute_streaming(stats))
    )


def test_expected_attention_unseen_page_is_uniform_times_value_norm():
    stats = _random_stats(0, 2, 3, 8, 4, unseen=True)
    got = ExpectedAttentionScorer(epsilon=0.0).page_scores(stats)
    want = stats.values[0].norm(dim=-1).T / 8  # [H, P]: uniform shares 1/P times ||v||
    torch.testing.assert_close(got[0], want)


def test_expected_attention_prefers_keys_aligned_with_the_queries():
    stats = _random_stats(1, 1, 1, 4, 2)
    keys = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]).view(1, 4, 1, 2)
    q = torch.tensor([[3.0, 0.0]] * 5)  # five identical queries: mean (3, 0), variance 0
    stats = PageStats(
        attn_sum=stats.attn_sum,
        obs_count=stats.obs_count,
        keys=keys,
        values=torch.ones(1, 4, 1, 2),
        q_sum=q.sum(0).view(1, 1, 2),
        q_sq_sum=q.square().sum(0).view(1, 1, 2),
        q_count=torch.tensor([5.0]),
        scale=1.0,
    )
    scores = ExpectedAttentionScorer().page_scores(stats)[0, 0]
    assert scores.argmax() == 0 and scores.argmin() == 1


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_scores_shape_dtype_and_finite_in_bfloat16(name):
    stats = _random_stats(2, 3, 2, 8, 4)
    half = dataclasses.replace(stats, keys=stats.keys.bfloat16(), values=stats.values.bfloat16())
    scores = make_scorer(name).page_scores(half)
    assert scores.shape == (3, 2, 8) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()


# ---- registry and flag --------------------------------------------------------------------

ALL = ["expected_attention", "h2o", "keydiff", "snapkv", "streaming"]


def test_registry_has_every_scorer_by_name():
    assert sorted(SCORERS) == ALL
    for name in ALL:
        scorer = make_scorer(name)
        assert isinstance(scorer, Scorer) and scorer.name == name


def test_make_scorer_unknown_lists_choices():
    with pytest.raises(ValueError, match="unknown scorer 'tova'") as err:
        make_scorer("tova")
    assert all(name in str(err.value) for name in ALL)


def test_ragged_scorer_flag_validation_lists_choices():
    for name in ALL:
        assert RaggedConfig(profile="uniform:0.3", scorer=name).scorer == name
    with pytest.raises(ValueError, match="--ragged-scorer 'nope' is unknown") as err:
        RaggedConfig.from_env({"RAGGED_PROFILE": "uniform:0.3", "RAGGED_SCORER": "nope"})
    assert all(name in str(err.value) for name in ALL)


# ---- serving: torch reference with every scorer ----------------------------------------------


class _Recorder(Scorer):
    """Delegates to a scorer and keeps every PageStats it was asked to score."""

    name = "recorder"

    def __init__(self, inner: Scorer) -> None:
        self.inner, self.calls = inner, []

    def page_scores(self, stats: PageStats) -> torch.Tensor:
        self.calls.append(stats)
        return self.inner.page_scores(stats)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_serving_query_stats_and_dense_oracle(name, monkeypatch):
    P = ragged.P
    rng = random.Random(7)
    budgets = [[rng.choice([0.5, 0.75]) for _ in range(ragged.H_KV)] for _ in range(ragged.LAYERS)]
    storage = ragged._storage(budgets, ragged.GROUPS_2)
    recorder = storage.sealer.scorer = _Recorder(make_scorer(name))
    # 1. Record, per layer, the window queries of every forward and which pages each sealed.
    # windows[layer]: (positions, queries) of each forward's window queries.
    windows: list[list[tuple[list[int], list]]] = [[] for _ in range(ragged.LAYERS)]
    # (layer, recorder call, page indices, forwards so far incl. the sealing one)
    sealed: list[tuple[int, int, list[int], int]] = []
    real_forward = ragged.request_forward

    def recording_forward(storage, layer, plan, q, k_new, v_new, scale):
        w = plan.obs_queries
        windows[layer].append((list(range(plan.seq_len - w, plan.seq_len)), q[-w:].tolist()))
        calls = len(recorder.calls)
        out = real_forward(storage, layer, plan, q, k_new, v_new, scale)
        if plan.num_seal:
            assert len(recorder.calls) == calls + 1
            first = plan.tail_start // P
            sealed.append(
                (layer, calls, list(range(first, first + plan.num_seal)), len(windows[layer]))
            )
        return out

    monkeypatch.setattr(ragged, "request_forward", recording_forward)
    # 2. Drive: a non-final chunk, a final chunk with a partial page, decode across pages;
    #    _Request.forward checks every output against dense attention over the kept tokens.
    req = ragged._Request(storage, torch.Generator().manual_seed(11))
    req.forward(2 * P, 1, final=False)
    req.forward(P + 3, 1, final=True)
    for _ in range(2 * P):
        req.forward(1, 1)
    storage.check_integrity(torch.tensor(req.free_pages))
    assert len({page for _, _, pages, _ in sealed for page in pages}) >= 4
    # 3. Each sealed page's statistics = brute-force sums over the window queries that saw it.
    for layer, call, pages, seen in sealed:
        stats, seen_windows = recorder.calls[call], windows[layer][:seen]
        for i, page_idx in enumerate(pages):
            want = _brute_query_stats(seen_windows, page_idx * P)
            torch.testing.assert_close(stats.q_sum[i], want[0], rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(stats.q_sq_sum[i], want[1], rtol=1e-5, atol=1e-4)
            assert float(stats.q_count[i]) == want[2]
            assert torch.equal(stats.keys[i], req.k[layer, page_idx * P : (page_idx + 1) * P])
            obs = [
                sum(t >= page_idx * P + j for pos, _ in seen_windows for t in pos) for j in range(P)
            ]
            assert stats.obs_count[i].tolist() == obs
    if name == "streaming":
        _check_keeps_latest(req, storage)


def _brute_query_stats(windows, page_start: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Sum, sum of squares [H_kv, D] and count (query vectors per KV head) of the window queries
    at positions >= page_start, pooled over the query heads of each KV head."""
    q_sum = [[0.0] * ragged.D for _ in range(ragged.H_KV)]
    q_sq = [[0.0] * ragged.D for _ in range(ragged.H_KV)]
    count = [0] * ragged.H_KV  # query vectors pooled into each KV head
    for positions, qs in windows:
        for pos, q in zip(positions, qs, strict=True):
            if pos < page_start:
                continue
            for hq, vec in enumerate(q):
                count[hq // ragged.GQA] += 1
                for j, x in enumerate(vec):
                    q_sum[hq // ragged.GQA][j] += x
                    q_sq[hq // ragged.GQA][j] += x * x
    assert len(set(count)) == 1, "every KV head pools the same number of query vectors"
    return torch.tensor(q_sum), torch.tensor(q_sq), float(count[0])


def _check_keeps_latest(req, storage) -> None:
    """With streaming, each head keeps its sinks plus the latest tokens of every sealed page."""
    P = ragged.P
    for layer in range(ragged.LAYERS):
        upto = int(storage.sealed.sum()) * P
        mask = req._kept_mask(layer, upto)
        for g, heads in enumerate(storage.layout.groups[layer]):
            k = storage.layout.slots[layer][g]
            for h in heads:
                for start in range(0, upto, P):
                    kept = mask[h, start : start + P].nonzero().flatten().tolist()
                    latest = list(range(P - k, P))
                    if start == 0:  # sinks forced in, then the latest of the rest
                        latest = list(range(4)) + list(range(P - (k - 4), P))
                    assert kept == latest, (layer, h, start, kept)
