"""RaggedStorage bookkeeping: a hypothesis state machine against a plain model, and the
integrity check catching each kind of corruption."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgl_ragged.mem_pool.storage import RaggedStorage, StagingExhaustedError
from sgl_ragged.profile import BudgetProfile, uniform_profile
from tests.unit.kernel_cases import make_storage

PAGES, STAGING, P = 12, 4, 8


def _storage() -> RaggedStorage:
    return make_storage(uniform_profile(0.5, 2, 2, 1), P, 4, PAGES, STAGING)


class StorageMachine(RuleBasedStateMachine):
    """Pages move free -> allocated -> (staged <-> sealed) -> free, as SGLang drives them."""

    def __init__(self) -> None:
        super().__init__()
        self.storage = _storage()
        self.free = set(range(1, PAGES))
        self.staged: set[int] = set()
        self.sealed: set[int] = set()
        self.allocated: set[int] = set()  # allocated, neither staged nor sealed yet

    @precondition(lambda self: self.free)
    @rule(data=st.data())
    def allocate(self, data):
        page = data.draw(st.sampled_from(sorted(self.free)))
        self.free.remove(page)
        self.allocated.add(page)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def stage(self, data):
        page = data.draw(st.sampled_from(sorted(self.allocated)))
        if len(self.staged) == STAGING:
            with pytest.raises(StagingExhaustedError):
                self.storage.stage(page)
            return
        self.storage.stage(page)
        self.allocated.remove(page)
        self.staged.add(page)

    @precondition(lambda self: self.staged or self.allocated)
    @rule(data=st.data())
    def seal(self, data):
        page = data.draw(st.sampled_from(sorted(self.staged | self.allocated)))
        self.storage.mark_sealed(torch.tensor([page]))
        self.staged.discard(page)
        self.allocated.discard(page)
        self.sealed.add(page)

    @precondition(lambda self: len(self.free) < PAGES - 1)
    @rule(data=st.data())
    def free_pages(self, data):
        held = sorted(self.allocated | self.staged | self.sealed)
        pages = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        self.storage.on_pages_freed(torch.tensor(pages))
        for page in pages:
            for s in (self.allocated, self.staged, self.sealed):
                s.discard(page)
            self.free.add(page)

    @invariant()
    def consistent(self):
        self.storage.check_integrity(torch.tensor(sorted(self.free), dtype=torch.long))
        assert self.storage.staging_in_use == len(self.staged)
        assert set(self.storage.sealed.nonzero().flatten().tolist()) == self.sealed
        assert set((self.storage.page_to_stage >= 0).nonzero().flatten().tolist()) == self.staged


TestStorageMachine = StorageMachine.TestCase
TestStorageMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_integrity_catches_double_free():
    storage = _storage()
    with pytest.raises(AssertionError, match="double free"):
        storage.check_integrity(torch.tensor([3, 3, 4]))


def test_integrity_catches_free_page_still_staged():
    storage = _storage()
    storage.stage(5)
    with pytest.raises(AssertionError, match="staging"):
        storage.check_integrity(torch.tensor([5]))


def test_integrity_catches_free_page_still_sealed():
    storage = _storage()
    storage.mark_sealed(torch.tensor([6]))
    with pytest.raises(AssertionError, match="sealed"):
        storage.check_integrity(torch.tensor([6]))


def test_integrity_catches_lost_staging_page():
    storage = _storage()
    storage.stage(2)
    storage.free_stage.append(storage.page_to_stage[2].item())  # corrupt: free while owned
    with pytest.raises(AssertionError):
        storage.check_integrity(torch.tensor([1]))


# ---- the write API: the storage's tensors change only through it -----------------------------


def test_staging_writes_and_finish_time_sealing():
    """stage_kv / store_stats / write_obs fill a staging page; seal_staged turns it into rows
    through the sealer (the same rows as write_sealed with the sealer's selection) and frees it."""
    storage = _storage()
    H, D = storage.layout.num_kv_heads, storage.layout.head_dim
    gen = torch.Generator().manual_seed(0)
    page, s = 4, storage.stage(4)
    k, v = torch.randn(1, P, H, D, generator=gen), torch.randn(1, P, H, D, generator=gen)
    stages = torch.tensor([s])
    acc = storage.stats.layer(0, stages)
    acc = type(acc)(attn=torch.rand(acc.attn.shape, generator=gen), q_sum=acc.q_sum,
                    q_sq_sum=acc.q_sq_sum, q_count=acc.q_count + 1)
    twin = copy.deepcopy(storage)
    storage.stage_kv(0, stages, k, v)
    storage.store_stats(0, stages, acc)
    storage.write_obs(s, torch.arange(1.0, P - 1))  # a partial count: the rest zero
    assert torch.equal(storage.stage_k[0][s], k[0]) and torch.equal(storage.stage_v[0][s], v[0])
    assert torch.equal(storage.stats.attn[s, 0], acc.attn[0])
    assert storage.stats.obs[s].tolist() == [*range(1, P - 1), 0.0, 0.0]
    stats = storage.stats.page_stats(0, stages, k, v, storage.scale)
    storage.seal_staged(torch.tensor([page]), torch.tensor([0]))
    twin.write_sealed(0, torch.tensor([page]), k, v,
                      twin.sealer.select(stats, torch.tensor([0])))
    for a, b in zip(storage.rows_k[0] + storage.rows_v[0], twin.rows_k[0] + twin.rows_v[0],
                    strict=True):
        assert torch.equal(a[page], b[page]) and a[page].abs().sum() > 0
    assert storage.sealed[page] and storage.page_to_stage[page] < 0 and storage.staging_in_use == 0
    assert storage.counters.pages_sealed == 1
    assert storage.counters.entries_seen == storage.layout.num_layers * P * H


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_sealing_through_head_slices_writes_what_head_indices_write(precision):
    """Adjacent KV heads of a group are sliced (a view) when sealing, others indexed: the rows
    are the same as through each group's index tensor (4 KV heads: groups (2, 3), (0, 1) and,
    in the second layer, the non-adjacent (0, 2), (3, 1))."""
    profile = BudgetProfile(model=None, budgets=[[0.5, 0.5, 0.25, 0.75], [0.5, 0.25, 0.5, 0.25]],
                            groups=[((2, 3), (0, 1)), ((0, 2), (3, 1))],
                            source={"kind": "uniform"})
    storage = make_storage(profile, P, 16, PAGES, STAGING, precision=precision)
    assert storage.head_span[0] == [slice(2, 4), slice(0, 2)]
    assert all(isinstance(h, torch.Tensor) for h in storage.head_span[1])
    twin = copy.deepcopy(storage)
    twin.head_span = twin.head_index
    gen = torch.Generator().manual_seed(3)
    pages, starts = torch.tensor([2, 5, 7]), torch.tensor([0, P, 2 * P])
    for layer in range(2):
        k, v = (torch.randn(3, P, 4, 16, generator=gen) for _ in range(2))
        stages = torch.arange(3)
        stats = storage.stats.page_stats(layer, stages, k, v, storage.scale)
        stats = dataclasses.replace(stats, attn_sum=torch.rand(stats.attn_sum.shape, generator=gen),
                                    obs_count=torch.ones(stats.obs_count.shape))
        for store in (storage, twin):
            store.write_sealed(layer, pages, k, v, store.sealer.select(stats, starts))
        mine = [*storage.rows_k[layer], *storage.rows_v[layer]]
        theirs = [*twin.rows_k[layer], *twin.rows_v[layer]]
        for tiers, other in zip(storage.low_rows[layer], twin.low_rows[layer], strict=True):
            if tiers is not None:
                mine += list(tiers.tensors())
                theirs += list(other.tensors())
        assert len(mine) > 2 * len(profile.groups[layer]) or precision == "bf16"
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b) and a[pages].abs().sum() > 0


def test_an_installed_row_writer_takes_every_row_write_and_refuses_copies():
    storage = _storage()
    calls = []
    storage.use_row_writer(lambda layer, pages, k, v, sel: calls.append((layer, pages.tolist())))
    s = storage.stage(3)
    storage.seal_staged(torch.tensor([3]), torch.tensor([P]))
    assert calls == [(layer, [3]) for layer in range(storage.layout.num_layers)]
    assert s not in storage.stage_owner.tolist() and storage.sealed[3]
    with pytest.raises(TypeError, match="deep-copied"):
        copy.deepcopy(storage)


STORAGE_FIELDS = {"rows_k", "rows_v", "low_rows", "high_rows", "row_keep", "stage_k", "stage_v",
                  "stats", "page_to_stage", "stage_owner", "sealed", "free_stage", "counters"}
"""RaggedStorage's tensor and bookkeeping fields: read-only outside mem_pool/."""


def _attribute_chain(node: ast.AST) -> set[str]:
    """Attribute names along x.a[i].b...: {'a', 'b', ...}."""
    names = set()
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        node = node.value
    return names


def storage_writes(source: str) -> list[int]:
    """Lines that write a storage field in place: item assignment into it (x.rows_k[l][g][p] =
    ..., +=), an assignment of one of its attributes (x.stats.attn = ...), or an in-place method
    called on it (x.stage_k[l].index_copy_(...), x.free_stage.append(...))."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and _attribute_chain(t) & STORAGE_FIELDS:
                lines.append(node.lineno)
            elif isinstance(t, ast.Attribute) and _attribute_chain(t.value) & STORAGE_FIELDS:
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            mutating = (method.endswith("_") and not method.startswith("_")) or method in (
                "append", "pop", "extend", "clear", "store", "reset")
            if mutating and _attribute_chain(node.func.value) & STORAGE_FIELDS:
                lines.append(node.lineno)
    return lines


def test_the_write_finder_finds_writes():
    source = ("st.stage_k[layer][s] = x\nst.rows_k[0][1][p] += y\nst.stats.attn = z\n"
              "st.stage_v[layer].index_copy_(0, s, x)\nst.stats.store(0, s, a)\n"
              "st.free_stage.append(3)\nx = st.rows_k[0][1][p]\nst.stats.layer(0, s)\n"
              "tails.stay_stage.fill_(0)\nout.index_copy_(0, r, y)\n")
    assert storage_writes(source) == [1, 2, 3, 4, 5, 6]


def test_nothing_outside_mem_pool_writes_a_storage_field():
    """Every path changes the storage through its write API (storage.py's docstring)."""
    root = Path(__file__).resolve().parents[2] / "sgl_ragged"
    found = {str(p.relative_to(root)): lines for p in sorted(root.rglob("*.py"))
             if p.parent.name != "mem_pool" and (lines := storage_writes(p.read_text()))}
    assert not found, f"storage fields written outside mem_pool/ (file: lines): {found}"


def test_native_store_stats_writes_what_the_torch_store_writes():
    """store_stats' native call (native_stats, the CPU server's) writes the staging statistics
    StagingStats.store's index_copy_ writes: random accumulators at random stages of random
    layers, a stage listed twice keeping its last row; the other rows untouched. Bad input is
    refused by name."""
    from sgl_ragged import native
    from sgl_ragged.mem_pool.staging_stats import StagedQueryStats

    if not native.available():
        pytest.skip(f"native kernels: {native.reason()}")
    gen = torch.Generator().manual_seed(3)
    storage = make_storage(uniform_profile(0.5, 3, 2, 1), P, 16, PAGES, 10)
    assert storage.native_stats
    for t in storage.stats.tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    twin = copy.deepcopy(storage)
    twin.native_stats = False
    H, D = storage.layout.num_kv_heads, storage.layout.head_dim
    for layer, stages in [(0, [3, 0, 9]), (2, [5, 5, 1, 7]), (1, []), (2, [10])]:
        n = len(stages)
        acc = StagedQueryStats(attn=torch.randn(n, H, P, generator=gen),
                               q_sum=torch.randn(n, H, D, generator=gen),
                               q_sq_sum=torch.randn(n, H, D, generator=gen),
                               q_count=torch.randn(n, generator=gen))
        index = torch.tensor(stages, dtype=torch.long)
        for store in storage, twin:
            store.store_stats(layer, index, acc)
        for a, b in zip(storage.stats.tensors(), twin.stats.tensors(), strict=True):
            assert torch.equal(a, b)
    assert storage.stats.q_count[5, 2] == twin.stats.q_count[5, 2]
    module, s = native.load(), storage.stats
    acc = (torch.zeros(1, H, P), torch.zeros(1, H, D), torch.zeros(1, H, D), torch.zeros(1))
    with pytest.raises(RuntimeError, match="stage 11 is outside"):
        module.store_stats(s.attn, s.q_sum, s.q_sq_sum, s.q_count, 0, torch.tensor([11]), *acc)
    with pytest.raises(RuntimeError, match="layer 3 outside"):
        module.store_stats(s.attn, s.q_sum, s.q_sq_sum, s.q_count, 3, torch.tensor([1]), *acc)
    with pytest.raises(RuntimeError, match="accumulators"):
        module.store_stats(s.attn, s.q_sum, s.q_sq_sum, s.q_count, 0, torch.tensor([1]),
                           torch.zeros(1, H, P + 1), *acc[1:])
