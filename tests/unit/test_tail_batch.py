"""Batched staging and sealing (tail_batch.store_tails) against the per-request reference.

Twin random storages (random rows, staging pages and accumulated statistics); random batches
of requests that hold staged tokens, add new ones, seal some complete tail pages and stage the
rest. The reference runs `TorchAttention` request by request; the batched path gets the same
queries' log-sum-exps and must leave the same rows, staging pages, statistics and counters.
Runs on the CPU with the torch sealer; the Triton sealer is covered in test_kernels_backend.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.tail_batch import (
    stage_fresh,
    store_tails,
    tail_batch,
    tail_pages,
)
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from tests.unit.kernel_cases import (
    D,
    P,
    Spec,
    assert_same_state,
    random_plans,
    random_qkv,
    random_specs,
    random_storage,
    reference_lse,
)

SCALE = 1 / math.sqrt(D)


def _run_both(seed: int, specs: list[Spec], layer: int, gap: int, in_place: bool = False) -> None:
    """in_place: through `stage_fresh` (no page sealed), the staging pages it must overwrite
    (those the request did not hold before) poisoned with NaN in both storages; it must also
    read back the pages `tail_pages` gathers. The pages a request held hold zeros past its end
    (random_plans), which an in-place forward leaves as they are."""
    batched, ref = (random_storage(random.Random(seed), "cpu", layers=2, num_stages=64)
                    for _ in range(2))
    plans = random_plans(batched, specs, random.Random(seed), gap=gap, twins=[ref])
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), "cpu")
    if in_place:
        for st in batched, ref:
            _poison_overwritten(st, plans, layer)
    # The batched path reads the log-sum-exps an attention kernel would return.
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"))  # rows no request owns: garbage
    for p in plans:
        rows = slice(p.q_start, p.q_start + p.q_len)
        lse[rows] = reference_lse(batched, layer, p, q[rows], k[rows], SCALE)
    tails = tail_batch(plans, P, torch.device("cpu"), in_place=in_place)
    assert tails.in_place == in_place
    if in_place:
        want = tail_pages(batched, layer, tails, k, v)
        k_pages, v_pages = stage_fresh(batched, layer, tails, k, v)
        assert torch.equal(k_pages, want[0]) and torch.equal(v_pages, want[1])
    else:
        k_pages, v_pages = tail_pages(batched, layer, tails, k, v)
    store_tails(batched, layer, tails, k_pages, v_pages, q, lse, SCALE, kv_staged=in_place)
    TorchAttention(ref).forward(layer, BatchPlan(requests=plans), q, k, v, SCALE, decode=False)
    assert_same_state(batched, ref)


def _poison_overwritten(st, plans, layer: int) -> None:
    """NaN in the staging pages a forward must overwrite in this layer: every slot and
    statistic of the staging pages a request did not hold before."""
    for p in plans:
        stages = p.after_stages[p.num_seal:]
        for i, s in enumerate(stages.tolist()):
            if i < p.prior_stages.numel():
                continue
            for t in st.stage_k[layer], st.stage_v[layer]:  # [S, P, H, D] of this layer
                t[s] = float("nan")
            for t in (st.stats.attn, st.stats.q_sum, st.stats.q_sq_sum, st.stats.q_count):
                t[s, layer] = float("nan")


def _in_place_specs(rng: random.Random, n: int) -> list[Spec]:
    """n requests that seal only pages staged before: decode steps (staged counts at random
    and at page boundaries: the new token fills a page, or opens one; some seal their first
    complete pages) and a few short chunks that seal nothing."""
    specs = []
    for _ in range(n):
        staged = rng.choice([rng.randrange(3 * P), P - 1, P, 2 * P - 1, 0])
        q_len = 1 if rng.random() < 0.75 else rng.randint(2, P)
        seal = rng.randint(0, staged // P) if q_len == 1 else 0
        specs.append(Spec(sealed=rng.randrange(3), staged=staged, q_len=q_len, seal=seal))
    return specs


@pytest.mark.parametrize("seed", range(8))
def test_stage_fresh_matches_reference(seed):
    """Forwards that seal nothing write only their tokens' staging slots (and zeros past each
    request's end): the whole storage then equals the reference's."""
    rng = random.Random(seed)
    _run_both(seed, _in_place_specs(rng, rng.randint(1, 6)), layer=seed % 2, gap=seed % 3,
              in_place=True)


def test_stage_fresh_refuses_seals_of_new_tokens():
    """A chunk whose sealed page holds new tokens has no staging slot for them: the tails
    are not in place, stage_fresh says to use tail_pages."""
    storage = random_storage(random.Random(1), "cpu", num_stages=64)
    plans = random_plans(storage, [Spec(sealed=1, staged=P - 1, q_len=1, seal=1),
                                   Spec(sealed=0, staged=3, q_len=P, seal=1)], random.Random(1))
    tails = tail_batch(plans, P, torch.device("cpu"), in_place=True)
    assert not tails.in_place
    k = torch.zeros(P + 1, storage.layout.num_kv_heads, D)
    with pytest.raises(ValueError, match="use tail_pages"):
        stage_fresh(storage, 0, tails, k, k)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decode", [False, True])
def test_store_tails_matches_reference(seed, decode):
    rng = random.Random(seed)
    _run_both(seed, random_specs(rng, rng.randint(1, 5), decode), layer=seed % 2, gap=seed % 3)


@pytest.mark.parametrize("spec", [
    Spec(sealed=0, staged=0, q_len=3 * P, seal=3),  # a whole chunk sealed straight away
    Spec(sealed=2, staged=P, q_len=1, seal=0),  # a staged full page, decode opens a new one
    Spec(sealed=1, staged=2 * P - 1, q_len=1, seal=1),  # decode completes a page, seals one
    Spec(sealed=0, staged=3, q_len=P - 3, seal=1),  # the partial page completes and seals
])
def test_store_tails_edge_cases(spec):
    _run_both(3, [spec, Spec(sealed=1, staged=5, q_len=2)], layer=1, gap=1)


def test_tail_batch_index_spaces():
    """Page order, token sources and windows for a two-request batch."""
    storage = random_storage(random.Random(1), "cpu", num_stages=64)
    plans = random_plans(storage, [Spec(sealed=1, staged=P + 2, q_len=P, seal=1),
                                   Spec(sealed=0, staged=0, q_len=3)], random.Random(1), gap=2)
    tails = tail_batch(plans, P, torch.device("cpu"))
    assert tails.page_req.tolist() == [0, 0, 0, 1]
    assert tails.page_start.tolist() == [P, 2 * P, 3 * P, 0]
    assert tails.has_prior.tolist() == [True, True, False, False]
    assert tails.prior_stage[:2].tolist() == plans[0].prior_stages.tolist()
    # Request 0: P + 2 staged tokens, then P fresh ones from row q_start; request 1: 3 fresh.
    assert tails.staged.sum(1).tolist() == [P, 2, 0, 0]
    assert tails.fresh.sum(1).tolist() == [0, P - 2, 2, 3]
    assert tails.new_row[1, 2].item() == plans[0].q_start
    assert tails.new_row[3, :3].tolist() == [plans[1].q_start + i for i in range(3)]
    assert tails.seal_index.tolist() == [0] and tails.stay_index.tolist() == [1, 2, 3]
    assert tails.seal_pages.tolist() == plans[0].tail_pages[:1].tolist()
    # Windows: the last min(4, q_len) queries of each request.
    assert tails.page_win_row[0].tolist() == [plans[0].q_start + P - 4 + j for j in range(4)]
    assert tails.page_win_row[3, :3].tolist() == [plans[1].q_start + j for j in range(3)]
    # Request 0's window holds positions 3P - 2 .. 3P + 1: two of them reach its third page.
    assert tails.page_saw.tolist() == [[1.0] * 4] * 2 + [[0.0, 0.0, 1.0, 1.0], [1.0] * 3 + [0.0]]
    # Query j of request 1 (position j) sees tokens 0..j of its page; the padded one nothing.
    sees = tails.page_sees[3, :, :4].int().tolist()
    assert sees == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("seed", range(12))
def test_host_tables_equal_the_torch_tables(seed):
    """tail_batch on the CPU (numpy, `_host_tail_batch`) builds every table the torch form
    (`_device_tail_batch`, what other devices run) builds, with the same dtypes: decode and
    prefill batches, sealing or not, observation windows of 1 to 32 queries, and the in-place
    tables where the forward allows them (and none where it does not)."""
    import dataclasses

    from sgl_ragged.attention_backend import tail_batch as module

    rng = random.Random(seed)
    storage = random_storage(rng, "cpu", num_stages=64)
    specs = (_in_place_specs(rng, rng.randint(1, 5)) if seed % 2
             else random_specs(rng, rng.randint(1, 5), decode=seed % 3 == 0))
    plans = [dataclasses.replace(p, obs_queries=min(p.q_len, rng.choice([1, 4, 32])))
             for p in random_plans(storage, specs, random.Random(seed), gap=seed % 3)]
    for in_place in (False, True):
        got = module._host_tail_batch(plans, P, in_place)
        want = module._device_tail_batch(plans, P, torch.device("cpu"), in_place)
        assert got.in_place == want.in_place
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), (field.name, a, b)
            else:
                assert a == b, field.name
    assert module.tail_batch(plans, P, torch.device("cpu")).page_req.numel() == sum(
        p.tail_pages.numel() for p in plans)
