"""The torch reference of ragged attention against dense attention over exactly the kept tokens.

A request is driven through prefill chunks and decode steps with random K/V; after each
forward the kept tokens of every (page, head) are recovered from the rows by matching them
against the full history, and every output must equal plain softmax attention over the
sealed kept tokens plus the full staged/new tail.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_ragged.attention_backend.planner import plan_batch, take_staging
from sgl_ragged.attention_backend.torch_ref import request_forward
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import BudgetProfile
from tests.unit.kernel_cases import make_storage

P, D, H_KV, GQA, LAYERS = 8, 16, 4, 2, 2


def _storage(budgets: list[list[float]], groups, window: int = 1,
             dynamic_rho: float | None = None) -> RaggedStorage:
    profile = BudgetProfile(model=None, budgets=budgets, groups=groups, source={"kind": "uniform"})
    return make_storage(profile, P, D, num_pages=64, num_staging_pages=8, dynamic_rho=dynamic_rho)


class _Request:
    """One request's full history and its row in req_to_token."""

    def __init__(self, storage: RaggedStorage, gen: torch.Generator) -> None:
        self.storage, self.gen = storage, gen
        self.k = torch.empty(LAYERS, 0, H_KV, D)
        self.v = torch.empty(LAYERS, 0, H_KV, D)
        self.req_to_token = torch.zeros(1, 256, dtype=torch.int64)
        self.free_pages = list(range(1, 64))
        random.Random(0).shuffle(self.free_pages)

    def forward(self, n_new: int, window: int, final: bool = True) -> list[torch.Tensor]:
        prefix = self.k.shape[1]
        seq_len = prefix + n_new
        self.allocate(prefix, seq_len)
        meta = take_staging(self.storage, plan_batch(self.req_to_token, self.storage, [0],
                                                      [prefix], [seq_len], window, obs_window=4,
                                                      final=[final]))
        k_new = torch.randn(LAYERS, n_new, H_KV, D, generator=self.gen)
        v_new = torch.randn(LAYERS, n_new, H_KV, D, generator=self.gen)
        self.k, self.v = torch.cat([self.k, k_new], 1), torch.cat([self.v, v_new], 1)
        outs = []
        for layer in range(LAYERS):
            q = torch.randn(n_new, H_KV * GQA, D, generator=self.gen)
            out = request_forward(self.storage, layer, meta.requests[0], q, k_new[layer],
                                  v_new[layer], 1 / math.sqrt(D))
            outs.append(out)
            torch.testing.assert_close(out, self._dense(layer, q, meta.requests[0]))
        self.storage.mark_sealed(meta.pages_to_seal)
        return outs

    def allocate(self, prefix: int, seq_len: int) -> None:
        """Logical pages for positions [prefix, seq_len), like SGLang's paged allocator."""
        for pos in range(prefix, seq_len):
            if pos % P == 0:
                page = self.free_pages.pop()
                self.req_to_token[0, pos : pos + P] = torch.arange(page * P, page * P + P)

    def _dense(self, layer: int, q: torch.Tensor, plan) -> torch.Tensor:
        """Softmax attention over the kept tokens of sealed pages plus the whole tail."""
        visible = self._kept_mask(layer, plan.tail_start)  # [H, tail_start]
        seq_len = self.k.shape[1]
        out = torch.empty_like(q)
        for hq in range(q.shape[1]):
            h = hq // GQA
            keys = torch.cat([self.k[layer, : plan.tail_start, h][visible[h]], self.k[layer, plan.tail_start :, h]])
            vals = torch.cat([self.v[layer, : plan.tail_start, h][visible[h]], self.v[layer, plan.tail_start :, h]])
            n_sealed = int(visible[h].sum())
            logits = q[:, hq] @ keys.T / math.sqrt(D)
            q_pos = torch.arange(plan.prefix, seq_len)
            k_pos = torch.cat([torch.full((n_sealed,), -1), torch.arange(plan.tail_start, seq_len)])
            logits.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            out[:, hq] = torch.softmax(logits, -1) @ vals
        return out

    def _kept_mask(self, layer: int, upto: int) -> torch.Tensor:
        """[H, upto] bool: which sealed tokens each head kept, recovered from the rows."""
        if self.storage.row_keep is not None:  # dynamic mode: full rows + a keep mask
            pages = self.req_to_token[0, 0:upto:P] // P
            return self.storage.row_keep[layer][pages].transpose(0, 1).flatten(1)
        mask = torch.zeros(H_KV, upto, dtype=torch.bool)
        for page_idx in range(upto // P):
            page = int(self.req_to_token[0, page_idx * P]) // P
            for g, heads in enumerate(self.storage.layout.groups[layer]):
                rows = self.storage.rows_k[layer][g][page]  # [k, H_p, D]
                for j, h in enumerate(heads):
                    full = self.k[layer, page_idx * P : (page_idx + 1) * P, h]
                    match = (rows[:, j, None, :] == full[None]).all(-1)  # [k, P]
                    assert (match.sum(1) == 1).all(), "a row slot is not a copy of one page token"
                    kept = match.float().argmax(1)
                    assert (kept.diff() > 0).all(), "kept slots are not in position order"
                    mask[h, page_idx * P + kept] = True
        return mask


GROUPS_1 = [((0, 1, 2, 3),)] * LAYERS
GROUPS_2 = [((0, 2), (1, 3)), ((0, 1), (2, 3))]


@pytest.mark.parametrize("groups", [GROUPS_1, GROUPS_2])
@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_dense_attention_over_kept_tokens(groups, window, seed):
    rng = random.Random(seed)
    budgets = [[rng.choice([0.5, 0.25, 0.75, 1.0]) for _ in range(H_KV)] for _ in range(LAYERS)]
    storage = _storage(budgets, groups)
    req = _Request(storage, torch.Generator().manual_seed(seed))
    req.forward(2 * P, window, final=False)  # a non-final chunk seals all its complete pages
    assert (storage.page_to_stage >= 0).sum() == 0
    req.forward(2 * P + 3, window, final=True)  # final chunk: window pages + partial tail staged
    assert (storage.page_to_stage >= 0).sum() == window + 1
    for _ in range(2 * P + 1):  # decode across page boundaries
        req.forward(1, window)
        assert (storage.page_to_stage >= 0).sum() <= window + 1
    storage.check_integrity(torch.tensor(req.free_pages))


def test_ratio_one_equals_full_attention():
    storage = _storage([[1.0] * H_KV] * LAYERS, GROUPS_2)
    req = _Request(storage, torch.Generator().manual_seed(3))
    req.forward(3 * P + 1, 1)
    for _ in range(P):
        req.forward(1, 1)
    sealed_pages = storage.sealed.nonzero().flatten()
    assert sealed_pages.numel() >= 3
    assert all(k == P for layer in storage.layout.slots for k in layer)


def test_sink_tokens_always_kept():
    storage = _storage([[0.5] * H_KV] * LAYERS, GROUPS_1)
    req = _Request(storage, torch.Generator().manual_seed(4))
    req.forward(2 * P, 0, final=False)
    mask = req._kept_mask(0, 2 * P)
    assert mask[:, :4].all()


@pytest.mark.parametrize("rho", [0.3, 0.6])
def test_dynamic_mode_masks_eq3_choice(rho):
    """Dynamic reference: rows stay full, attention skips what Eq. 3 dropped, and each sealing
    keeps exactly ceil(rho * H * N) entries of a layer with sinks in, unevenly across heads."""
    storage = _storage([[1.0] * H_KV] * LAYERS, GROUPS_2, dynamic_rho=rho)
    req = _Request(storage, torch.Generator().manual_seed(5))
    req.forward(3 * P, 0, final=False)  # one sealing of 3 pages per layer
    for layer in range(LAYERS):
        kept = req._kept_mask(layer, 3 * P)  # [H, 3P]
        assert int(kept.sum()) == math.ceil(rho * H_KV * 3 * P)
        assert kept[:, :4].all()
        assert kept.float().mean(1).std() > 0, "Eq. 3 should give heads different retention"
    req.forward(P + 2, 1)
    for _ in range(P + 1):
        req.forward(1, 1)
    assert storage.counters.entries_kept < storage.counters.entries_seen
    storage.check_integrity(torch.tensor(req.free_pages))
