"""Planning a forward (attention_backend/planner.py): reading the storage allocates nothing,
staging pages are taken in one explicit step, chunk boundaries come in as an input; and the
per-forward values that used to be parked on the storage (scale, staging statistics)."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from sgl_ragged.attention_backend.chunks import PrefillChunks
from sgl_ragged.attention_backend.planner import plan_batch, take_staging
from sgl_ragged.attention_backend.triton_batch import triton_batch
from sgl_ragged.mem_pool.sealer import SealBatch
from sgl_ragged.mem_pool.staging_stats import StagingStats
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import uniform_profile
from sgl_ragged.serving.runtime import attention_scale
from tests.unit.kernel_cases import make_storage

P, D = 8, 4


def _storage(**kwargs) -> RaggedStorage:
    return make_storage(uniform_profile(0.5, 2, 2, 1), P, D, 16, 6, **kwargs)


def _req_to_token(rows: int) -> torch.Tensor:
    """Row r holds pages 1 + 4r .. 4 + 4r."""
    table = torch.zeros(rows, 4 * P, dtype=torch.int64)
    for r in range(rows):
        table[r] = torch.arange((1 + 4 * r) * P, (5 + 4 * r) * P)
    return table


def _bookkeeping(storage: RaggedStorage) -> list:
    return [storage.page_to_stage.clone(), storage.stage_owner.clone(), list(storage.free_stage),
            *(t.clone() for t in storage.stats.tensors())]


def test_planning_allocates_nothing_until_take_staging():
    storage = _storage()
    table = _req_to_token(2)
    before = _bookkeeping(storage)
    # Request 0: a 2P + 3 token prefill (window 1: page 2 and the partial page 3 stay).
    # Request 1: a non-final chunk of 2P tokens (window 0: both pages sealed).
    plan = plan_batch(table, storage, [0, 1], [0, 0], [2 * P + 3, 2 * P], 1, 4, [True, False])
    for a, b in zip(_bookkeeping(storage), before, strict=True):
        assert a == b if isinstance(a, list) else torch.equal(a, b)
    assert not plan.staged
    assert plan.requests[0].after_stages.tolist() == [-1, -1]
    assert plan.requests[1].num_seal == 2 and plan.requests[1].after_stages.numel() == 0
    assert plan.pages_to_seal.tolist() == [1, 5, 6]
    staged = take_staging(storage, plan)
    assert staged.staged and take_staging(storage, staged) is staged
    stages = staged.requests[0].after_stages.tolist()
    assert sorted(stages) == [0, 1] and storage.page_to_stage[[2, 3]].tolist() == stages
    # Observation counts of the staged tokens: the last 4 queries (positions 2P-1 .. 2P+2).
    obs = storage.stats.obs[stages].flatten()[: P + 3]
    assert obs.tolist() == [float(min(4, max(0, 2 * P + 3 - pos))) for pos in range(P, 2 * P + 3)]


def test_final_defaults_to_true_and_prefill_chunks_are_taken_once():
    storage = _storage()
    table = _req_to_token(1)
    assert plan_batch(table, storage, [0], [0], [2 * P], 1, 4).requests[0].num_seal == 1
    assert plan_batch(table, storage, [0], [0], [2 * P], 1, 4, [False]).requests[0].num_seal == 2
    chunks = PrefillChunks()
    chunks.record(3, False)
    chunks.record(5, True)
    assert chunks.take([5, 3, 7]) == [True, False, True]
    assert chunks.take([3]) == [True]  # forgotten once taken


def test_attention_scale_comes_from_the_model_config():
    assert attention_scale(SimpleNamespace(), 64) == 64**-0.5
    assert attention_scale(SimpleNamespace(query_pre_attn_scalar=256), 128) == 256**-0.5
    assert attention_scale(SimpleNamespace(query_pre_attn_scalar=None), 16) == 0.25
    assert _storage().scale == 1 / math.sqrt(D)
    assert _storage(scale=0.5).scale == 0.5


def test_staging_stats_bytes_match_what_is_allocated():
    stats = StagingStats.allocate(3, 2, 4, P, D, torch.device("cpu"))
    assert stats.nbytes == 3 * StagingStats.bytes_per_page(2, 4, P, D)
    storage = _storage()
    layout = storage.layout
    assert storage.stats.nbytes == (storage.num_staging_pages + 1) * (
        layout.staging_bytes_per_page() - layout.full_bytes_per_page)
    stats.attn.fill_(1.0)
    stats.obs.fill_(1.0)
    stats.reset(1)
    assert stats.attn[1].abs().sum() == 0 and stats.obs[1].abs().sum() == 0
    assert stats.attn[0].abs().sum() > 0


def test_sealer_counts_only_what_the_batch_says():
    """A captured graph's padded batch seals with count 0 (graph.py counts at load)."""
    storage = _storage()
    twin = copy.deepcopy(storage)
    stages = torch.tensor([0, 1])
    keys = torch.randn(2, P, 2, D)
    stats = storage.stats.page_stats(0, stages, keys, keys, storage.scale)
    batch = SealBatch(stats, torch.tensor([3, 4]), torch.tensor([0, P]), count=0)
    storage.seal(0, batch)
    assert storage.counters.entries_seen == 0
    twin.seal(0, SealBatch(stats, batch.pages, batch.page_start, count=2))
    assert twin.counters.entries_seen == 2 * P * 2
    assert twin.counters.entries_kept == 2 * sum(twin.layout.slots[0]) * 1
    for a, b in zip(storage.rows_k[0], twin.rows_k[0], strict=True):
        assert torch.equal(a, b)  # the same rows either way


def _reference_plan(req_to_token, storage, pool_idx, prefixes, seq_lens, window_pages,
                    obs_window, final):
    """The planner as it was written request by request in torch ops (its brute-force form):
    plans and, after taking staging, the observation counts written page by page."""
    plans, q_start = [], 0
    for r, prefix, seq_len, last in zip(pool_idx, prefixes, seq_lens, final, strict=True):
        row = req_to_token[r]
        old = (row[0:prefix:P] // P).cpu().long()
        staged = storage.page_to_stage[old] >= 0
        num_sealed = int((~staged).long().cumsum(0).eq(torch.arange(1, len(old) + 1)).sum())
        tail_start = num_sealed * P
        prior = storage.page_to_stage[old[num_sealed:]]
        tail = (row[tail_start:seq_len:P] // P).cpu().long()
        num_seal = max(0, seq_len // P - num_sealed - (window_pages if last else 0))
        obs = torch.zeros(seq_len - tail_start)
        if prior.numel():
            obs[: prefix - tail_start] = storage.stats.obs[prior].flatten()[: prefix - tail_start]
        w = min(obs_window, seq_len - prefix)
        q_pos = torch.arange(seq_len - w, seq_len)
        obs += (q_pos[None, :] >= torch.arange(tail_start, seq_len)[:, None]).sum(1).float()
        plans.append(dict(q_start=q_start, prefix=prefix, seq_len=seq_len, tail_start=tail_start,
                          sealed_pages=old[:num_sealed], prior_stages=prior, tail_pages=tail,
                          num_seal=num_seal, after_stages=storage.page_to_stage[tail[num_seal:]],
                          tail_obs=obs, obs_queries=w))
        q_start += seq_len - prefix
    return plans


def _random_batch(rng, storage, rows: int):
    """Requests of random sealed runs, staged pages (the last partly staged or whole) and new
    tokens (decode or a chunk), on distinct pages; staging statistics random."""
    table = torch.zeros(rows, 16 * P, dtype=torch.int32)
    free = list(range(1, storage.num_pages))
    rng.shuffle(free)
    prefixes, seq_lens = [], []
    for r in range(rows):
        sealed, staged = rng.randrange(4), rng.randrange(3)
        prefix = (sealed + staged) * P - (rng.randrange(P) if staged else 0)
        seq_len = prefix + (1 if rng.random() < 0.5 else rng.randint(2, 3 * P))
        for i in range(-(-seq_len // P)):
            page = free.pop()
            table[r, i * P:(i + 1) * P] = torch.arange(page * P, page * P + P)
            if i < sealed:
                storage.sealed[page] = True
            elif i < sealed + staged:
                storage.stage(page)
        prefixes.append(prefix)
        seq_lens.append(seq_len)
    storage.stats.obs.copy_(torch.randint(0, 9, storage.stats.obs.shape).float())
    return table, prefixes, seq_lens


def test_plans_equal_the_per_request_reference():
    """plan_batch on host arrays plans every request as the per-request torch form did (every
    field, random batches of sealed runs, staged pages, decode steps and chunks, windows 0-2,
    final and non-final chunks, observation windows 1-32), and take_staging writes the same
    observation counts as writing them page by page."""
    import random

    for seed in range(40):
        rng = random.Random(seed)
        storage = make_storage(uniform_profile(0.5, 2, 2, 1), P, D, 200, 60)
        rows = rng.randint(1, 6)
        table, prefixes, seq_lens = _random_batch(rng, storage, rows)
        pool_idx = rng.sample(range(rows), rows)
        prefixes = [prefixes[r] for r in pool_idx]
        seq_lens = [seq_lens[r] for r in pool_idx]
        window, obs_window = rng.randrange(3), rng.choice([1, 4, 32])
        final = [rng.random() < 0.7 for _ in pool_idx]
        want = _reference_plan(table, storage, pool_idx, prefixes, seq_lens, window, obs_window,
                               final)
        plan = plan_batch(table, storage, pool_idx, prefixes, seq_lens, window, obs_window, final)
        assert len(plan.requests) == len(want)
        for got, ref in zip(plan.requests, want, strict=True):
            for name, value in ref.items():
                mine = getattr(got, name)
                assert (torch.equal(mine, value) if isinstance(value, torch.Tensor)
                        else mine == value), (seed, name, mine, value)
        assert plan.pages_to_seal.tolist() == [t for p in want
                                               for t in p["tail_pages"][: p["num_seal"]].tolist()]
        twin = copy.deepcopy(storage)
        staged = take_staging(storage, plan)
        for p in want:  # the reference: stage in request order, counts page by page
            for i, page in enumerate(p["tail_pages"][p["num_seal"]:].tolist()):
                s = int(twin.page_to_stage[page])
                s = s if s >= 0 else twin.stage(page)
                twin.write_obs(s, p["tail_obs"][(p["num_seal"] + i) * P:(p["num_seal"] + i + 1) * P])
        for a, b in zip(_bookkeeping(storage), _bookkeeping(twin), strict=True):
            assert a == b if isinstance(a, list) else torch.equal(a, b), seed
        assert [p.after_stages.tolist() for p in staged.requests] == [
            twin.page_to_stage[p["tail_pages"][p["num_seal"]:]].tolist() for p in want]


def test_a_staged_page_two_requests_share_keeps_the_last_counts():
    """Two requests whose tails share a staged page (a prefix both cached): its counts are
    the later request's, as when they were written request by request."""
    storage = _storage()
    table = torch.zeros(2, 4 * P, dtype=torch.int64)
    table[0, : 2 * P] = torch.arange(1 * P, 3 * P)  # pages 1, 2
    table[1, : 2 * P] = torch.arange(1 * P, 3 * P)  # the same pages
    table[1, 2 * P : 3 * P] = torch.arange(3 * P, 4 * P)  # then its own page 3
    stage = storage.stage(2)
    storage.sealed[1] = True
    storage.write_obs(stage, torch.full((P,), 5.0))
    plan = take_staging(storage, plan_batch(table, storage, [0, 1], [2 * P - 1, 2 * P],
                                            [2 * P, 2 * P + 1], 1, 4))
    assert plan.requests[0].after_stages.tolist() == [stage]
    assert plan.requests[1].after_stages[0] == stage
    assert storage.stats.obs[stage].tolist() == plan.requests[1].tail_obs[:P].tolist()
    assert storage.stats.obs[stage].tolist() != plan.requests[0].tail_obs[:P].tolist()


def test_bad_prefixes_are_refused_by_name():
    """A cached page neither sealed nor staged, a sealed page after a staged one, and a prefix
    ending inside a sealed page are refused with what is wrong."""
    import pytest

    table = _req_to_token(1)
    for setup, prefix, message in [
        (lambda st: None, 2 * P, "neither sealed nor staged"),
        (lambda st: (st.stage(1), st.sealed.__setitem__(2, True)), 2 * P,
         "a sealed page follows a staged page"),
        (lambda st: st.sealed.__setitem__(slice(1, 3), True), 2 * P - 3,
         "needs page-aligned prefixes"),
    ]:
        storage = _storage()
        setup(storage)
        with pytest.raises(RuntimeError, match=message):
            plan_batch(table, storage, [0], [prefix], [prefix + 1], 1, 4)


def _same_tables(a: object, b: object) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.device == y.device and torch.equal(x.cpu(), y.cpu()), f.name
        else:
            assert x == y, f.name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams; "
                    "scripts/gpu_check.sh runs this)")
def test_planning_does_not_wait_for_the_forward_in_flight():
    """SGLang's overlap scheduler plans batch N + 1 while forward N still runs on the forward
    stream; it wrote N + 1's req_to_token rows on its own stream (follow_scheduler records it).
    Here forward N is a long sleep: planning on the forward stream (plan_batch, take_staging
    and the Triton path's tables) must not wait for it on the host, and must give what
    planning on an idle device gives."""
    import random

    rng = random.Random(3)
    storage = make_storage(uniform_profile(0.5, 2, 2, 1), P, D, 200, 60, device="cuda")
    rows = 4
    table, prefixes, seq_lens = _random_batch(rng, storage, rows)
    pool_idx = list(range(rows))
    scheduler, forward = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(scheduler):
        req_to_token = table.cuda()
        storage.follow_scheduler()
    twin = copy.deepcopy(storage)
    want = take_staging(twin, plan_batch(req_to_token, twin, pool_idx, prefixes, seq_lens, 1, 4))
    want_tables = triton_batch(want, P, torch.device("cuda"))
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        storage.follow_forward()
        torch.cuda._sleep(200_000_000)  # forward N (about 0.1 s)
        plan = take_staging(storage, plan_batch(req_to_token, storage, pool_idx, prefixes,
                                                seq_lens, 1, 4))
        tables = triton_batch(plan, P, torch.device("cuda"))
        waited = forward.query()
    torch.cuda.synchronize()
    for got, ref in zip(plan.requests, want.requests, strict=True):
        _same_tables(got, ref)
    _same_tables(tables.kernel, want_tables.kernel)
    _same_tables(tables.tails, want_tables.tails)
    assert not waited, ("planning waited on the host for the forward in flight: its plan is "
                        "right, but it stalls SGLang's overlap scheduler")
