"""The batch's req_to_token rows as a host list (serving/backend.py `_pool_indices`), noted by
the ForwardBatch.init_new hook: on CUDA, reading req_pool_indices back would wait for the
forward in flight; on a CPU the two are compared, so every CPU server checks the hook's
assumption (ScheduleBatch.reqs in req_pool_indices order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sgl_ragged.serving import backend, scheduler_hooks  # noqa: E402
from sgl_ragged.serving.server_args import ACTIVE_ENV  # noqa: E402


def _schedule_batch(rows: list[int]) -> SimpleNamespace:
    return SimpleNamespace(reqs=[SimpleNamespace(kv=SimpleNamespace(req_pool_idx=r)) for r in rows])


def _forward_batch(rows: list[int], lens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(req_pool_indices=torch.tensor(rows), seq_lens_cpu=torch.tensor(lens))


@pytest.fixture(autouse=True)
def _active(monkeypatch):
    monkeypatch.setenv(ACTIVE_ENV, "1")
    backend.note_forward_batch(None)


def test_the_noted_rows_are_the_batchs():
    built = _forward_batch([5, 2, 9], [70, 12, 33])
    scheduler_hooks.after_forward_batch_init(built, object, _schedule_batch([5, 2, 9]), None)
    assert backend._noted == ([5, 2, 9], [70, 12, 33])
    copy = _forward_batch([5, 2, 9, 0], [70, 12, 33, 1])  # a runner's padded copy of it
    assert backend._pool_indices(copy, 3) == [5, 2, 9]


def test_noted_rows_are_taken_once():
    built = _forward_batch([1, 4], [8, 9])
    scheduler_hooks.after_forward_batch_init(built, object, _schedule_batch([1, 4]), None)
    assert backend._pool_indices(built, 2) == [1, 4]
    assert backend._noted is None
    assert backend._pool_indices(built, 2) == [1, 4]  # the tensor's, read again


def test_rows_of_another_batch_are_not_used():
    scheduler_hooks.after_forward_batch_init(_forward_batch([1, 4], [8, 9]), object,
                                             _schedule_batch([1, 4]), None)
    other = _forward_batch([3, 7], [8, 10])  # other lengths: not the noted batch
    assert backend._pool_indices(other, 2) == [3, 7]


def test_a_stock_server_notes_nothing(monkeypatch):
    monkeypatch.delenv(ACTIVE_ENV)
    scheduler_hooks.after_forward_batch_init(_forward_batch([1], [5]), object,
                                             _schedule_batch([1]), None)
    assert backend._noted is None


def test_a_batch_without_requests_clears_the_note():
    backend.note_forward_batch(([1], [5]))
    scheduler_hooks.after_forward_batch_init(_forward_batch([], []), object,
                                             _schedule_batch([]), None)
    assert backend._noted is None


def test_rows_that_disagree_with_the_tensor_are_refused():
    scheduler_hooks.after_forward_batch_init(_forward_batch([3, 4], [6, 6]), object,
                                             _schedule_batch([4, 3]), None)
    with pytest.raises(RuntimeError, match=r"req_pool_indices are \[3, 4\]"):
        backend._pool_indices(_forward_batch([3, 4], [6, 6]), 2)
