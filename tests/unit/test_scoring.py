"""SnapKV scoring and per-head selection against brute-force versions."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ragged.scoring import SINK_TOKENS, PageStats, SnapKVScorer
from sgl_ragged.scoring.select import select_top_k, sink_mask
from sgl_ragged.scoring.snapkv import gqa_reduce, window_attention_probs


def _brute_select(scores: list[float], k: int, sinks: list[bool]) -> list[int]:
    """Best k subset: sinks first, then highest scores, ties to earlier positions; sorted."""
    order = sorted(range(len(scores)), key=lambda i: (not sinks[i], -scores[i], i))
    return sorted(order[:k])


@settings(max_examples=200, deadline=None)
@given(
    page=st.integers(4, 12),
    data=st.data(),
)
def test_select_top_k_matches_brute_force(page, data):
    k = data.draw(st.integers(SINK_TOKENS, page))  # the layout guarantees k >= SINK_TOKENS
    start = data.draw(st.sampled_from([0, page, 2 * page]))
    # Few distinct values so ties happen often.
    scores = data.draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0]), min_size=page, max_size=page))
    sinks = sink_mask(torch.tensor([start]), page)
    got = select_top_k(torch.tensor([[scores]]), k, sinks)[0, 0].tolist()
    assert got == _brute_select(scores, k, sinks[0].tolist())


def test_sinks_only_in_first_page():
    mask = sink_mask(torch.tensor([0, 8, 16]), 8)
    assert mask[0, :SINK_TOKENS].all() and not mask[0, SINK_TOKENS:].any()
    assert not mask[1:].any()


def _brute_snapkv(attn_sum: list[list[float]], obs: list[float], kernel: int) -> list[list[float]]:
    out = []
    for row in attn_sum:
        mean = [a / max(o, 1.0) for a, o in zip(row, obs, strict=True)]
        r = kernel // 2
        out.append([max(mean[max(0, i - r) : i + r + 1]) for i in range(len(mean))])
    return out


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_snapkv_page_scores_match_brute_force(data):
    h, p = data.draw(st.integers(1, 3)), data.draw(st.integers(4, 10))
    attn = data.draw(st.lists(st.lists(st.floats(0, 4), min_size=p, max_size=p), min_size=h, max_size=h))
    obs = data.draw(st.lists(st.integers(0, 5).map(float), min_size=p, max_size=p))
    got = SnapKVScorer(7).page_scores(_stats(torch.tensor([attn]), torch.tensor([obs])))
    torch.testing.assert_close(got[0], torch.tensor(_brute_snapkv(attn, obs, 7)))


def _stats(attn_sum: torch.Tensor, obs: torch.Tensor, d: int = 4) -> PageStats:
    """PageStats around given attention sums [N, H, P]; keys, values and queries random."""
    n, h, p = attn_sum.shape
    g = torch.Generator().manual_seed(1)
    return PageStats(attn_sum=attn_sum, obs_count=obs, keys=torch.randn(n, p, h, d, generator=g),
                     values=torch.randn(n, p, h, d, generator=g), q_sum=torch.randn(n, h, d, generator=g),
                     q_sq_sum=torch.rand(n, h, d, generator=g) + 1, q_count=torch.ones(n), scale=d**-0.5)


def test_window_probs_and_gqa_reduce_match_loops():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    q_pos, k_pos = torch.tensor([3, 4, 5]), torch.arange(6)
    probs = window_attention_probs(q, k, q_pos, k_pos, 0.5)
    for qi, hq in itertools.product(range(3), range(4)):
        logits = [(q[qi, hq] @ k[n, hq // 2]).item() * 0.5 if n <= q_pos[qi] else -math.inf for n in range(6)]
        m = max(logits)
        e = [math.exp(x - m) for x in logits]
        torch.testing.assert_close(probs[qi, hq], torch.tensor([x / sum(e) for x in e]))
    red = gqa_reduce(probs, 2)
    torch.testing.assert_close(red[:, 1], torch.maximum(probs[:, 2], probs[:, 3]))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_select_flat_top_matches_brute_force(data):
    from sgl_ragged.scoring.select import select_flat_top

    h, n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 12))
    rho = data.draw(st.sampled_from([0.1, 0.3, 0.5, 0.7, 1.0]))
    scores = data.draw(st.lists(st.sampled_from([0.0, 0.2, 0.5, 1.0]), min_size=h * n, max_size=h * n))
    sinks = [i < data.draw(st.integers(0, 2)) for i in range(n)]
    keep = select_flat_top(torch.tensor(scores).view(h, n), rho, torch.tensor(sinks))
    # Brute force: rank (head, token) pairs by (not sink, -score, flat index), take the budget.
    budget = min(h * n, max(math.ceil(rho * h * n), sum(sinks) * h))
    ranked = sorted(range(h * n), key=lambda i: (not sinks[i % n], -scores[i], i))
    want = torch.zeros(h * n, dtype=torch.bool)
    want[ranked[:budget]] = True
    assert torch.equal(keep.flatten(), want)
