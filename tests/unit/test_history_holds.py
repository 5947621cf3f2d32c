"""--ragged-hold-history (serving/history_holds.py) on SGLang's own RadixCache.

The tree is SGLang 0.5.23's RadixCache over a fake allocator that records what eviction frees;
time is a fake clock. Each test checks what eviction and admission can take (`evict`,
`evictable_size`) with holds against the same tree without them.
"""

from __future__ import annotations

import os
from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from sgl_ragged.serving import history_holds  # noqa: E402
from sgl_ragged.serving.history_holds import HistoryHolds, hold_limit, hold_seconds  # noqa: E402


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
    holds = HistoryHolds(tree, 10.0, clock=clock, min_outcomes=0)  # hold from the start
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
    short = HistoryHolds(tree, 10.0, page_size=4, min_outcomes=0)
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
    monkeypatch.setenv(history_holds.AUTO_ENV, "0")  # auto, resolved to off (stock SGLang)
    history_holds.after_checkpoint(None, tree, _finished_req(node), up_to=8)
    assert history_holds.holds_of(tree) is None and tree.protected_size() == 0
    monkeypatch.setenv(history_holds.ENV, "5")
    assert history_holds.holds_of(tree) is None  # a tree reads the environment once
    tree = _tree()
    node = _insert(tree, list(range(8)), 0)
    history_holds.after_checkpoint(None, tree, _finished_req(node, finished=False), up_to=8)
    history_holds.after_checkpoint(None, tree, _finished_req(node, aborted=True), up_to=8)
    assert tree.protected_size() == 0
    history_holds.after_checkpoint(None, tree, _finished_req(node), up_to=8)
    holds = history_holds.holds_of(tree)
    # remembered and held (a fresh server knows no outcomes yet)
    assert holds is not None and holds.seconds == 5 and list(holds.holds) == [node]
    assert [list(f.tokens) for f in holds.finished.values()] == [list(range(8))]
    assert tree.protected_size() == 8
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


@pytest.mark.parametrize("value", ["x", "-1", "inf", "nan"])
def test_hold_limit_refuses_what_is_not_seconds(value: str) -> None:
    with pytest.raises(ValueError, match="--ragged-hold-limit expects"):
        hold_limit({history_holds.LIMIT_ENV: value})
    assert hold_limit({}) == history_holds.DEFAULT_LIMIT == 120
    from sgl_ragged.config import FLAGS  # the flag table states the same default

    assert float(next(f for f in FLAGS if f.env == history_holds.LIMIT_ENV).default) == 120
    assert hold_limit({history_holds.LIMIT_ENV: "0"}) == 0


def test_launch_refuses_a_bad_hold_limit(monkeypatch) -> None:
    from sgl_ragged.serving.server_args import _check_history_holds

    monkeypatch.setenv(history_holds.AUTO_ENV, "0")  # restored after the test
    monkeypatch.setenv(history_holds.LIMIT_ENV, "soon")
    with pytest.raises(ValueError, match="--ragged-hold-limit expects seconds"):
        _check_history_holds(SimpleNamespace(tp_size=1, pp_size=1))


def test_refused_with_tensor_or_pipeline_parallel_ranks(monkeypatch) -> None:
    from sgl_ragged.serving.server_args import _check_history_holds

    monkeypatch.setenv(history_holds.AUTO_ENV, "0")  # restored after the test
    monkeypatch.setenv(history_holds.ENV, "10")
    _check_history_holds(SimpleNamespace(tp_size=1, pp_size=1))
    for cfg in (SimpleNamespace(tp_size=2, pp_size=1), SimpleNamespace(tp_size=1, pp_size=2)):
        with pytest.raises(ValueError, match="not supported with --(tp|pp)-size 2"):
            _check_history_holds(cfg)
    for off in ("0", "auto"):  # off, or auto (which leaves holds off there): no error
        monkeypatch.setenv(history_holds.ENV, off)
        _check_history_holds(SimpleNamespace(tp_size=2, pp_size=1))
        assert hold_seconds() == 0


@pytest.mark.parametrize("ragged, tp, pp, seconds", [(True, 1, 1, history_holds.DEFAULT_SECONDS),
                                                     (True, 2, 1, 0.0), (True, 1, 4, 0.0),
                                                     (False, 1, 1, 0.0)])
@pytest.mark.parametrize("given", [None, "auto", " AUTO "])
def test_auto_holds_with_the_ragged_backend_on_one_rank(monkeypatch, ragged: bool, tp: int,
                                                        pp: int, seconds: float,
                                                        given: str | None) -> None:
    """auto (the default): 2 s for a ragged server whose one scheduler rank decides alone; off
    for stock SGLang and for TP/PP ranks; the launcher resolves it for its children (env)."""
    from sgl_ragged.serving import server_args

    monkeypatch.setenv(history_holds.AUTO_ENV, "0")
    if given is None:
        monkeypatch.delenv(history_holds.ENV, raising=False)
    else:
        monkeypatch.setenv(history_holds.ENV, given)
    if ragged:
        monkeypatch.setenv(server_args.ACTIVE_ENV, "1")
    else:
        monkeypatch.delenv(server_args.ACTIVE_ENV, raising=False)
    server_args._check_history_holds(SimpleNamespace(tp_size=tp, pp_size=pp))
    assert hold_seconds() == seconds
    child = {history_holds.AUTO_ENV: os.environ[history_holds.AUTO_ENV]}  # what children inherit
    assert hold_seconds(child) == seconds
    monkeypatch.setenv(history_holds.ENV, "0")  # given seconds win over auto
    assert hold_seconds() == 0


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
    holds = HistoryHolds(tree, 10.0, clock=Clock(), min_outcomes=0)
    turn = _waiting(_conversation(0) + [1], "t")
    holds.take(7, _conversation(0))
    assert holds.waiting_nodes([turn]) == {7}
    holds.release(7)
    holds.take(7, _conversation(1))
    assert holds.waiting_nodes([turn]) == set()


# ---- holding only while conversations come back ------------------------------------------------


def _ids_tree() -> SimpleNamespace:
    """A tree whose nodes are ids (as the Rust core's), recording what is locked."""
    locked: set = set()
    return SimpleNamespace(locked=locked, lock=lambda node: locked.add(node) or node,
                           unlock=lambda node: locked.discard(node))


def test_a_fresh_server_holds_until_conversations_do_not_come_back() -> None:
    clock = Clock()
    holds = HistoryHolds(_ids_tree(), 10.0, clock=clock)
    for s in range(4):  # nothing known yet: held; nobody continues them
        holds.take(s, _conversation(s))
        clock.now += 3
        holds.sweep([])
    assert holds.taken == 4 and list(holds.outcomes) == [False]  # 3 s apart, 10 s each
    clock.now += 10
    holds.sweep([])
    assert list(holds.outcomes) == [False] * 4 and not holds.returning() and not holds.holds
    holds.take(9, _conversation(9))
    assert not holds.holds and 9 not in holds.tree.locked  # remembered only
    for s in (10, 11):  # two conversations come back: 2 of 6, a third
        holds.take(s, _conversation(s))
        clock.now += 1
        holds.sweep([_waiting(_conversation(s) + [1], f"turn-2-{s}")])
    assert holds.returning() and holds.taken == 4
    holds.take(12, _conversation(12))
    assert list(holds.holds) == [12] and holds.taken == 5


def test_single_requests_stop_holding_once_known() -> None:
    """Conversations nobody continues within the hold time count as gone: once MIN_OUTCOMES of
    them are known, no more holds."""
    clock = Clock()
    holds = HistoryHolds(_ids_tree(), 10.0, clock=clock)
    for s in range(40):
        holds.sweep([_waiting([7] * 9, f"other-{s}")])  # new requests, no next turns
        holds.take(s, _conversation(s))
        clock.now += 3
    # taken at 0, 3, ..., 18 s: the fourth outcome is known at 19 s (the one taken at 9 s)
    assert holds.taken == 7 and not holds.holds and len(holds.outcomes) == 32
    assert not any(holds.outcomes) and len(holds.finished) == 4  # the last 10 s: pending


def test_late_or_early_requests_are_not_returns() -> None:
    """A next turn after the hold time is a new arrival (its conversation was gone); a request
    waiting before the conversation finished is not its next turn."""
    clock = Clock()
    holds = HistoryHolds(_ids_tree(), 10.0, clock=clock)
    early = _waiting(_conversation(0) + [1], "early")
    holds.sweep([early])
    holds.take(0, _conversation(0))
    holds.sweep([early])
    clock.now += 10
    holds.sweep([early, _waiting(_conversation(0) + [1], "late")])
    assert list(holds.outcomes) == [False]


@pytest.mark.parametrize("returned, gone, holding", [(2, 4, True), (1, 3, False), (2, 2, True),
                                                     (0, 4, False), (0, 3, True), (3, 0, True),
                                                     (11, 21, True), (10, 22, False)])
def test_the_share_that_comes_back(returned: int, gone: int, holding: bool) -> None:
    holds = HistoryHolds(_ids_tree(), 10.0)
    holds.outcomes.extend([True] * returned + [False] * gone)
    assert holds.returning() is holding  # a third; and while fewer than MIN_OUTCOMES (4) known


def test_hold_decisions_match_a_brute_force_replay() -> None:
    """Random sessions (1-5 turns, next turns after random gaps, some past the hold time): every
    take holds exactly when the outcomes a direct replay of the schedule gives, known at that
    moment and in their order, say at least a third of the latest 32 came back, or fewer than
    4 are known."""
    import random

    rng = random.Random(7)
    seconds = 5.0
    events = []  # (time, kind, session, turn): kind 0 an arrival, 1 a finish
    turns = {}
    for s in range(60):
        t = rng.uniform(0, 200)
        turns[s] = rng.choice([1, 1, 2, 3, 5])
        for turn in range(turns[s]):
            if turn:
                t += rng.choice([rng.uniform(0.1, 4.0), rng.uniform(5.5, 9.0)])
                events.append((t, 0, s, turn))
            t += rng.uniform(0.5, 3.0)
            events.append((t, 1, s, turn))
    events.sort()

    def tokens(s: int, turn: int) -> list[int]:
        return [1000 + s] + [s * 10 + i for i in range(2 * turn + 2)]

    # the replay: each finished conversation's outcome, resolved at the arrival of its next turn
    # within `seconds`, else at the first event at or after its deadline (expiries first)
    finished_at = {(s, turn): t for t, kind, s, turn in events if kind == 1}
    arrived_at = {(s, turn): t for t, kind, s, turn in events if kind == 0}
    times = [t for t, *_ in events]
    resolved = []  # (time, expiry 0 / return 1, finish order, outcome)
    order = {key: i for i, key in enumerate(sorted(finished_at, key=finished_at.get))}
    for (s, turn), t in finished_at.items():
        nxt = arrived_at.get((s, turn + 1))
        if nxt is not None and nxt - t < seconds:
            resolved.append((nxt, 1, order[s, turn], True))
        else:
            at = next((e for e in times if e >= t + seconds), None)
            if at is not None:
                resolved.append((at, 0, order[s, turn], False))
    resolved.sort()

    clock = Clock()
    holds = HistoryHolds(_ids_tree(), seconds, clock=clock)
    for t, kind, s, turn in events:
        clock.now = t
        if kind == 0:
            holds.sweep([_waiting(tokens(s, turn - 1) + [5, 5], f"{s}-{turn}")])
            continue
        holds.sweep([])
        known = [ok for at, *_, ok in resolved if at <= t][-32:]
        expect = len(known) < 4 or 3 * sum(known) >= len(known)
        was = holds.taken
        holds.take((s, turn), tokens(s, turn))
        assert (holds.taken == was + 1) is expect, (t, s, turn, known)
    assert 0 < holds.taken < len(finished_at)  # both decisions were exercised


# ---- the limit: sessions that keep coming back do not keep a new one waiting for ever ----------


def _turn(s: int, turn: int) -> list[int]:
    """Session `s`'s conversation after `turn` + 1 turns (each turn adds two tokens)."""
    return [1000 + s] + [s * 10 + i for i in range(2 * turn + 2)]


def test_a_starving_request_stops_holding_long_held_conversations() -> None:
    """Session 0 comes back every 4 s; a new session waits from t=1. Past the hold time (2 s) it
    is starving; session 0, held since t=0, is held again until its chain is older than the
    limit (10 s), then not; the turn after that starts a new chain."""
    clock = Clock()
    clock.now = 0.0
    holds = HistoryHolds(_ids_tree(), 2.0, clock=clock, min_outcomes=0, limit=10.0)
    new = _waiting([7] * 9, "new")
    holds.take(("s0", 0), _turn(0, 0))
    held = []
    for turn in range(1, 6):
        clock.now = 4.0 * turn - 3  # the next turn arrives, waits, then runs for 3 s
        nxt = _waiting(_turn(0, turn - 1) + [5], f"s0-{turn}")
        holds.sweep([nxt, new])
        assert getattr(nxt, history_holds._CHAIN, None) == {4: None, 5: 16.0}.get(turn, 0.0)
        assert holds.starving is (turn > 1)  # `new` waits from t=1: over 2 s from t=5
        clock.now += 3
        holds.sweep([new])
        holds.take(("s0", turn), _turn(0, turn), getattr(nxt, history_holds._CHAIN, None))
        held.append(("s0", turn) in holds.holds)
    # finished at 4, 8, 12 (chain 0: 12 s > 10, starving), 16 (not held before: a new chain), 20
    assert held == [True, True, False, True, True] and holds.limited == 1


@pytest.mark.parametrize("starving, limit, held", [(False, 10.0, True), (True, 10.0, False),
                                                   (True, 0.0, True), (True, 30.0, True)])
def test_the_limit_applies_only_while_a_request_starves(starving: bool, limit: float,
                                                       held: bool) -> None:
    clock = Clock()
    holds = HistoryHolds(_ids_tree(), 2.0, clock=clock, min_outcomes=0, limit=limit)
    new = _waiting([7] * 9, "new")
    holds.sweep([new])
    clock.now += 3 if starving else 1
    holds.sweep([new])
    assert holds.starving is starving
    holds.take("n", _turn(0, 3), chain=clock.now - 20)  # held turn after turn for 20 s
    assert ("n" in holds.holds) is held


def test_held_turns_waiting_do_not_starve_and_chains_pass_through_the_hook(monkeypatch) -> None:
    """A waiting request that continues a held conversation is not starving however long it
    waits; the checkpoint hook takes its chain from the request."""
    clock = Clock()
    tree = _ids_tree()
    holds = HistoryHolds(tree, 2.0, clock=clock, min_outcomes=0, limit=10.0)
    holds.take("a", _turn(0, 0))
    turn = _waiting(_turn(0, 0) + [5], "a-1")
    for _ in range(5):
        holds.sweep([turn])
        clock.now += 1.5
    assert not holds.starving and getattr(turn, history_holds._CHAIN) == 100.0
    tree.__dict__["_ragged_history_holds"] = holds
    holds.starving = True
    clock.now = 111.0  # the chain is 11 s old
    req = SimpleNamespace(last_node="b", finished=lambda: True, finished_reason=None,
                          full_untruncated_fill_ids=array("q", _turn(0, 1)))
    setattr(req, history_holds._CHAIN, getattr(turn, history_holds._CHAIN))
    history_holds.after_checkpoint(None, tree, req, up_to=4)
    assert "b" not in holds.holds and holds.limited == 1
    del req._ragged_hold_chain  # a conversation that was not held: a new chain
    history_holds.after_checkpoint(None, tree, req, up_to=4)
    assert "b" in holds.holds and holds.holds["b"].chain == 111.0


# ---- the scheduler's cost: one lookup a waiting request and step --------------------------------


def test_continues_matches_a_brute_force_prefix_check() -> None:
    """The two probed tokens reject early; what they let through is the whole prefix check."""
    import random

    rng = random.Random(3)
    holds = HistoryHolds(_ids_tree(), 2.0, page_size=4)
    for _ in range(3000):
        tokens = array("q", [rng.randrange(3) for _ in range(rng.randrange(8, 24))])
        prompt = list(tokens[:rng.randrange(len(tokens) + 1)]) + [rng.randrange(3) for _ in range(
            rng.randrange(6))]
        if prompt and rng.random() < 0.5:  # change one token somewhere
            i = rng.randrange(len(prompt))
            prompt[i] = rng.randrange(3)
        n = len(tokens) - 4
        assert holds._continues(prompt, tokens) is (len(prompt) >= n and prompt[:n] == list(tokens[:n]))


def test_a_waiting_request_is_matched_to_the_holds_once() -> None:
    clock = Clock()
    holds = HistoryHolds(_ids_tree(), 10.0, clock=clock, min_outcomes=0)
    before = _waiting(_turn(2, 0) + [5], "before")  # waits before its conversation finished
    holds.sweep([before])
    for s in range(3):
        holds.take(s, _turn(s, 0))
    turn = _waiting(_turn(1, 0) + [5], "turn")
    new = _waiting([7] * 9, "new")
    calls = []
    find = holds._find_hold
    holds._find_hold = lambda req: calls.append(req.rid) or find(req)
    for _ in range(5):
        clock.now += 3
        holds.sweep([before, turn, new])
        holds.held_turns_first(waiting := [new, before, turn])
        assert waiting == [turn, new, before]
    assert sorted(calls) == ["new", "turn"]  # once each, at its first sight (`before`: earlier)
    assert holds.waiting_nodes([before, turn, new]) == {1}  # `before` is not its next turn
    assert set(holds.holds) == {1}  # renewed while its turn waits; the others expired
    holds.release(1)
    holds.take(1, _turn(3, 0))  # the node id comes back for another conversation
    assert holds.waiting_nodes([turn]) == set() and calls.count("turn") == 1
