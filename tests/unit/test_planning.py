"""Planning a forward (attention_backend/planner.py): reading the storage allocates nothing,
staging pages are taken in one explicit step, chunk boundaries come in as an input; and the
per-forward values that used to be parked on the storage (scale, staging statistics)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch

from sgl_ragged.attention_backend.chunks import PrefillChunks
from sgl_ragged.attention_backend.planner import plan_batch, take_staging
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
