"""RaggedStorage bookkeeping: a hypothesis state machine against a plain model, and the
integrity check catching each kind of corruption."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgl_ragged.mem_pool.storage import RaggedStorage, StagingExhaustedError
from sgl_ragged.profile import uniform_profile
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
