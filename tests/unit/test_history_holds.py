"""--ragged-hold-history (serving/history_holds.py) on SGLang's own RadixCache.

The tree is SGLang 0.5.23's RadixCache over a fake allocator that records what eviction frees;
time is a fake clock. Each test checks what eviction and admission can take (`evict`,
`evictable_size`) with holds against the same tree without them.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from sgl_ragged.serving import history_holds  # noqa: E402
from sgl_ragged.serving.history_holds import HistoryHolds, hold_seconds  # noqa: E402


class FakeAllocator:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free_segment(self, value: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += value.tolist()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tree() -> RadixCache:
    return RadixCache.create_simulated(mock_allocator=FakeAllocator())


def _insert(tree: RadixCache, tokens: list[int], first_slot: int) -> object:
    """Insert a conversation; return the node that ends it (what checkpoint leaves in last_node)."""
    key = RadixKey(array("l", tokens))
    tree.insert(InsertParams(key=key, value=torch.arange(first_slot, first_slot + len(tokens))))
    return tree.match_prefix(MatchPrefixParams(key=key)).last_device_node


def _conversation(s: int) -> list[int]:
    return [s * 100 + i for i in range(8)]


def _waiting(tokens: list[int], rid: str) -> SimpleNamespace:
    """A waiting request whose prompt is `tokens`."""
    return SimpleNamespace(rid=rid, origin_input_ids=array("q", tokens))


@pytest.fixture
def three() -> tuple[RadixCache, Clock, HistoryHolds, list[object]]:
    """Three 8-token conversations with distinct first tokens, the first two held."""
    tree, clock = _tree(), Clock()
    holds = HistoryHolds(tree, 10.0, clock=clock)
    nodes = [_insert(tree, _conversation(s), 8 * s) for s in range(3)]
    holds.take(nodes[0], _conversation(0))
    clock.now += 1
    holds.take(nodes[1], _conversation(1))
    return tree, clock, holds, nodes


def test_held_histories_are_neither_evicted_nor_room(three) -> None:
    tree, _, holds, nodes = three
    assert tree.evictable_size() == 8  # only the third: admission counts 8 tokens of room
    assert tree.protected_size() == 16
    tree.evict(EvictParams(num_tokens=24))
    assert sorted(tree.token_to_kv_pool_allocator.freed) == list(range(16, 24))
    assert tree.evictable_size() == 0 and tree.protected_size() == 16

    # Without holds the same eviction takes all three.
    plain = _tree()
    for s in range(3):
        _insert(plain, [s * 100 + i for i in range(8)], 8 * s)
    assert plain.evictable_size() == 24
    plain.evict(EvictParams(num_tokens=24))
    assert sorted(plain.token_to_kv_pool_allocator.freed) == list(range(24))


def test_holds_end_when_their_time_is_up(three) -> None:
    tree, clock, holds, nodes = three
    clock.now += 9.5  # the first was taken 10.5 s ago, the second 9.5
    holds.sweep()
    assert list(holds.holds) == [nodes[1]] and tree.evictable_size() == 16
    clock.now += 1
    holds.sweep()
    assert not holds.holds and tree.evictable_size() == 24 and tree.protected_size() == 0


def test_a_waiting_next_turn_renews_its_hold(three) -> None:
    tree, clock, holds, nodes = three
    # The first session's next turn waits: its prompt is the conversation (its last token
    # rendered otherwise by the chat template) and a new message.
    turn2 = _waiting(_conversation(0)[:7] + [5, 7, 7, 7, 7], "t2")
    clock.now += 9
    holds.sweep([turn2])
    clock.now += 5  # 15 s after the first hold was taken, 14 after the second
    holds.sweep([turn2])
    assert list(holds.holds) == [nodes[0]]
    other = _waiting(_conversation(0)[:6] + [5, 5, 7, 7, 7], "other")  # parts earlier
    assert holds.waiting_nodes([other]) == set()


def test_pressure_ends_unmatched_holds_oldest_first(three) -> None:
    tree, clock, holds, nodes = three
    clock.now += 1
    holds.take(nodes[2], _conversation(2))
    waiting = [_waiting(_conversation(0) + [1, 2], "a")]  # the oldest hold's next turn waits
    fresh = _insert(tree, _conversation(3), 24)
    clock.now += 6  # the three past half their time
    holds.take(fresh, _conversation(3))  # a turn that just ended: its next one may be coming
    assert holds.relieve(waiting) and fresh in holds.holds
    assert set(holds.holds) == {nodes[0], nodes[2], fresh}  # the second: unmatched, oldest
    assert holds.relieve(waiting) and set(holds.holds) == {nodes[0], fresh}
    assert holds.relieve(waiting) and list(holds.holds) == [fresh]  # the older of the kept
    assert holds.relieve(waiting) and not holds.holds
    assert not holds.relieve(waiting)
    assert holds.released_under_pressure == 4 and tree.protected_size() == 0


def test_taking_the_same_node_again_renews_it(three) -> None:
    tree, clock, holds, nodes = three
    clock.now += 8
    holds.take(nodes[0], _conversation(0))
    assert nodes[0].lock_ref == 1 and holds.taken == 2
    clock.now += 5
    holds.sweep()
    assert list(holds.holds) == [nodes[0]]


def test_short_conversations_and_reset(three) -> None:
    tree, _, holds, _ = three
    holds.take(tree.root_node, [])
    short = HistoryHolds(tree, 10.0, page_size=4)
    short.take(_insert(tree, [7, 7, 7, 7, 7, 7, 7], 40), [7, 7, 7, 7, 7, 7, 7])  # 1 whole page
    assert len(holds.holds) == 2 and not short.holds
    tree.__dict__["_ragged_history_holds"] = holds
    tree.reset()
    history_holds.after_reset(None, tree)
    assert not holds.holds and tree.protected_size() == 0


def _finished_req(node: object, finished: bool = True, aborted: bool = False) -> SimpleNamespace:
    reason = type("FINISH_ABORT" if aborted else "FINISH_LENGTH", (), {})()
    return SimpleNamespace(last_node=node, finished=lambda: finished,
                           finished_reason=reason if finished else None,
                           full_untruncated_fill_ids=array("q", range(10)))


def test_checkpoint_hook_holds_finished_requests_only(monkeypatch) -> None:
    tree = _tree()
    node = _insert(tree, list(range(8)), 0)
    monkeypatch.delenv(history_holds.ENV, raising=False)
    history_holds.after_checkpoint(None, tree, _finished_req(node), up_to=8)
    assert history_holds.holds_of(tree) is None and tree.protected_size() == 0  # off by default
    monkeypatch.setenv(history_holds.ENV, "5")
    history_holds.after_checkpoint(None, tree, _finished_req(node, finished=False), up_to=8)
    history_holds.after_checkpoint(None, tree, _finished_req(node, aborted=True), up_to=8)
    assert tree.protected_size() == 0
    history_holds.after_checkpoint(None, tree, _finished_req(node), up_to=8)
    holds = history_holds.holds_of(tree)
    assert holds is not None and holds.seconds == 5 and list(holds.holds) == [node]
    assert list(holds.holds[node].tokens) == list(range(8))  # what the tree keeps


def test_decode_releases_holds_before_retracting(three) -> None:
    tree, _, holds, _ = three
    tree.__dict__["_ragged_history_holds"] = holds
    batch = SimpleNamespace(tree_cache=tree)
    calls = []

    def check_decode_mem(b: object) -> bool:  # room after eviction, as the allocator's check
        calls.append(tree.evictable_size())
        return tree.evictable_size() >= 16

    assert history_holds.around_check_decode_mem(check_decode_mem, batch)
    assert calls == [8, 16] and len(holds.holds) == 1 and holds.released_under_pressure == 1


def test_idle_server_releases_holds_until_a_waiting_request_fits(three) -> None:
    tree, _, holds, nodes = three
    tree.__dict__["_ragged_history_holds"] = holds
    empty = SimpleNamespace(is_empty=lambda: True)
    cold = _waiting([9, 9, 9], "cold")
    scheduler = SimpleNamespace(tree_cache=tree, waiting_queue=[cold], chunked_req=None)

    def get_new_batch_prefill(s: object, running: object) -> SimpleNamespace:
        fits = tree.evictable_size() >= 24  # the cold request needs all of it
        return SimpleNamespace(batch_to_run="batch" if fits else None, running_batch=running)

    plan = history_holds.around_get_new_batch_prefill(get_new_batch_prefill, scheduler, empty)
    assert plan.batch_to_run == "batch" and not holds.holds

    # With a request running, holds stay: the running one will give room back.
    holds.take(nodes[0], _conversation(0))
    busy = SimpleNamespace(is_empty=lambda: False)
    plan = history_holds.around_get_new_batch_prefill(get_new_batch_prefill, scheduler, busy)
    assert plan.batch_to_run is None and list(holds.holds) == [nodes[0]]


@pytest.mark.parametrize("value", ["x", "-1", "inf", "nan"])
def test_hold_seconds_refuses_what_is_not_seconds(value: str) -> None:
    with pytest.raises(ValueError, match="--ragged-hold-history"):
        hold_seconds({history_holds.ENV: value})
    assert hold_seconds({}) == 0 and hold_seconds({history_holds.ENV: "2.5"}) == 2.5


def test_refused_with_tensor_or_pipeline_parallel_ranks(monkeypatch) -> None:
    from sgl_ragged.serving.server_args import _check_history_holds

    monkeypatch.setenv(history_holds.ENV, "10")
    _check_history_holds(SimpleNamespace(tp_size=1, pp_size=1))
    for cfg in (SimpleNamespace(tp_size=2, pp_size=1), SimpleNamespace(tp_size=1, pp_size=2)):
        with pytest.raises(ValueError, match="not supported with --(tp|pp)-size 2"):
            _check_history_holds(cfg)
    monkeypatch.setenv(history_holds.ENV, "0")
    _check_history_holds(SimpleNamespace(tp_size=2, pp_size=1))


def test_turns_of_held_conversations_are_admitted_first(three) -> None:
    tree, _, holds, nodes = three
    queue = [_waiting([1, 2, 3], "new-1"), _waiting(_conversation(2) + [1], "unheld"),
             _waiting(_conversation(1) + [1], "held-1"), _waiting([], "new-2"),
             _waiting(_conversation(0) + [1], "held-0")]
    holds.held_turns_first(queue)
    assert [r.rid for r in queue] == ["held-1", "held-0", "new-1", "unheld", "new-2"]


def test_a_node_id_that_comes_back_holds_another_conversation() -> None:
    """The Rust tree core's nodes are ids, and a freed id may end another conversation later."""
    tree = SimpleNamespace(lock=lambda node: ("lock", node), unlock=lambda lock: None)
    holds = HistoryHolds(tree, 10.0, clock=Clock())
    turn = _waiting(_conversation(0) + [1], "t")
    holds.take(7, _conversation(0))
    assert holds.waiting_nodes([turn]) == {7}
    holds.release(7)
    holds.take(7, _conversation(1))
    assert holds.waiting_nodes([turn]) == set()
