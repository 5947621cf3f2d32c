"""Hold a finished request's history in the radix cache until its next turn (--ragged-hold-history).

Multi-turn chat sends each turn as the whole conversation so far. Where the active sessions'
histories outgrow the KV pool, SGLang's admission counts every unlocked cached prefix as free
room: a request whose history is not cached (a new session, or one already evicted) is admitted
and its prefill evicts the least recently used histories, which under sessions that come round
in turn are the ones needed next. Every turn then prefills its whole history again (session 55:
1.8% of prompt tokens cached at a 0.3 pool with 16 active sessions, 65% at 0.15).

This is TANGRAM's budget reservation applied across turns: when a request finishes, the radix
node that ends its conversation is locked (a "hold"). A locked node is neither evicted nor
counted as room by admission, so a request that would need it waits, and the session's next
turn finds its history cached. Waiting turns of held conversations are admitted first. A hold
ends
- `seconds` after its turn ended, or after its next turn was last seen waiting (so a session
  whose next turn does not come within `seconds`, one that ended, gives its room back; a new
  session waits for that while the pool is full of held conversations);
- under pressure, the oldest first, past half their time and not continued by a waiting turn
  before the others: before a decode step would retract a running request, and when nothing
  runs and nothing waiting could be admitted (holds never stall the server).
`seconds` is the time a client takes to send its next turn: about a second for programs (agents,
benchmarks); people think for longer than a pool can afford to hold their pages idle.

Holds keep a new session waiting while the pool is full of held conversations, and a session
that keeps coming back could keep it waiting for ever. So while a request that continues no held
conversation has waited longer than `seconds`, a conversation that has been held turn after turn
for longer than `limit` (--ragged-hold-limit) is not held again when its turn ends: its pages go
to the waiting request, and the conversation, should its history be evicted, starts holding
afresh after its next turn. Holds are never ended early for it (their turns are on their way).

Holds are taken only while conversations come back. Every finished conversation is remembered
(its tokens, not its pages) for `seconds`: a waiting request that continues it within that time
counts as a return, else it counts as gone. Finished conversations are held while at least
RETURN_SHARE of the latest RETURN_WINDOW whose fate is known came back, and until MIN_OUTCOMES
are known (a fresh server holds: a wrong hold keeps pages idle for at most `seconds`, a missed
one costs its history's prefill); otherwise they are only remembered. Single-turn traffic (no
returns) thus holds its first few conversations and then none.

auto (the default) is DEFAULT_SECONDS with the ragged backend where one scheduler rank decides
alone, else off (stock SGLang keeps its own admission unless asked). Given seconds, every
server of the environment holds (stock SGLang too, for like-for-like comparisons); a scheduler
keeps its holds on its own tree, and given seconds are refused with --tp-size or --pp-size above
1, whose ranks must make the same scheduling decisions and would each read their own clock.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

ENV = "RAGGED_HOLD_HISTORY"
AUTO = "auto"
AUTO_ENV = "RAGGED_HOLD_HISTORY_AUTO"  # what auto resolved to for this server (resolve_auto)
# auto's hold time with the ragged backend: the time a program takes to send its next turn
DEFAULT_SECONDS = 2.0
_ATTR = "_ragged_history_holds"
# Holds are taken while at least RETURN_SHARE of the latest RETURN_WINDOW finished conversations
# whose fate is known came back within the hold time, and until MIN_OUTCOMES are known. A hold that
# returns saves its whole history's prefill; one that does not keeps its pages idle for at most
# `seconds` and is the first to go under pressure; so a third is enough (sessions of two turns
# come back half the time, of three two thirds; single requests never).
RETURN_SHARE = Fraction(1, 3)
RETURN_WINDOW = 32
MIN_OUTCOMES = 4
LIMIT_ENV = "RAGGED_HOLD_LIMIT"
# --ragged-hold-limit's default: seconds a conversation stays held, turn after turn, while a
# request that continues no held conversation waits (0: no limit)
DEFAULT_LIMIT = 120.0
_CHAIN = "_ragged_hold_chain"  # on a waiting request: since when its conversation has been held


def hold_seconds(environ: dict[str, str] | None = None) -> float:
    """--ragged-hold-history as seconds (0: off); auto (or unset) is what the launcher resolved
    it to for this server (AUTO_ENV; `resolve_auto`); a clear error for anything else."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip().lower()
    if value in ("", AUTO):
        value = env.get(AUTO_ENV, "0")
    return _seconds("--ragged-hold-history", value, env.get(ENV),
                    "seconds (e.g. 10, or 0 for off) or auto")


def hold_limit(environ: dict[str, str] | None = None) -> float:
    """--ragged-hold-limit as seconds (0: no limit); a clear error for anything else."""
    env = os.environ if environ is None else environ
    value = env.get(LIMIT_ENV, "").strip() or f"{DEFAULT_LIMIT:g}"
    return _seconds("--ragged-hold-limit", value, env.get(LIMIT_ENV),
                    "seconds (e.g. 120, or 0 for no limit)")


def _seconds(flag: str, value: str, given: str | None, expects: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{flag} expects {expects}, got {given!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{flag} expects a finite number of seconds >= 0, got {given!r}")
    return seconds


def explicit(environ: dict[str, str] | None = None) -> bool:
    """Whether --ragged-hold-history was given as seconds (not auto, not unset)."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "").strip().lower() not in ("", AUTO)


def resolve_auto(ragged: bool, one_rank: bool) -> float:
    """What auto means for the server being launched (main process, before its children
    start, which inherit it): DEFAULT_SECONDS with the ragged backend where one scheduler rank
    decides alone (holds read each rank's clock), else off; stock SGLang keeps its own
    admission unless asked."""
    seconds = DEFAULT_SECONDS if ragged and one_rank else 0.0
    os.environ[AUTO_ENV] = f"{seconds:g}"
    return seconds


@dataclass
class Finished:
    """A finished conversation remembered for `seconds`: will a waiting request continue it?"""

    tokens: array  # its tokens (whole pages)
    deadline: float


@dataclass
class Hold:
    lock: Any  # the tree's TreeLock on the node
    tokens: array  # the conversation's tokens the node ends (whole pages)
    taken: float  # when it was taken or last renewed (release order under pressure)
    deadline: float
    serial: int  # its conversation's number (a released node's id may come back for another one)
    chain: float  # since when its conversation has been held, turn after turn (--ragged-hold-limit)


@dataclass(slots=True)
class Waiting:
    """What the holds know of a waiting request, from the sweep that first saw it."""

    since: float  # when it was first seen waiting
    hold: tuple[Any, int] | None  # (node, serial) of the held conversation it continues


class HistoryHolds:
    """The holds of one radix tree. Nodes are whatever the tree's `lock` takes (SGLang's Python
    RadixCache's nodes, or the Rust tree core's opaque node ids), so a waiting request is matched
    to a hold by its tokens, not by walking the tree. `limit` is --ragged-hold-limit (0: none);
    `clock` is injectable for tests."""

    def __init__(self, tree: Any, seconds: float, page_size: int = 1,
                 clock: Callable[[], float] = time.monotonic, min_outcomes: int = MIN_OUTCOMES,
                 limit: float = DEFAULT_LIMIT):
        self.tree = tree
        self.seconds = seconds
        self.limit = limit
        self.page_size = max(1, page_size)
        self.clock = clock
        self.min_outcomes = min_outcomes
        self.holds: dict[Any, Hold] = {}  # node -> its hold
        self.finished: dict[int, Finished] = {}  # serial -> conversation not yet continued
        self.outcomes: deque[bool] = deque(maxlen=RETURN_WINDOW)  # came back within `seconds`
        self._waiting: dict[Any, Waiting] = {}  # waiting request id -> what its first sight found
        self.starving = False  # a request that continues no hold has waited over `seconds`
        self.serial = 0  # counters (tests, logs): conversations finished, holds taken, ...
        self.taken = 0
        self.released_under_pressure = 0
        self.expired = 0
        self.limited = 0  # finished turns not held again for a waiting request (limit)
        self._logged = float("-inf")

    # ---- taking and ending holds ------------------------------------------------------------

    def returning(self) -> bool:
        """Whether finished conversations come back (RETURN_SHARE of the latest outcomes), or
        too few are known to say they do not."""
        known = len(self.outcomes)
        return known < self.min_outcomes or sum(self.outcomes) >= RETURN_SHARE * known

    def take(self, node: Any, tokens: Any, chain: float | None = None) -> None:
        """Remember the finished conversation `tokens`, which `node` ends, for `seconds`; hold
        `node` meanwhile while conversations come back, unless it has been held since `chain`
        (its turn continued a held conversation) for longer than `limit` while a request that
        continues no hold is starving. Conversations shorter than two pages are neither
        remembered nor held."""
        length = len(tokens) // self.page_size * self.page_size
        if node is None or length < 2 * self.page_size:
            return
        now = self.clock()
        chain = now if chain is None else chain
        self.serial += 1
        conversation = array("q", tokens[:length])
        self.finished[self.serial] = Finished(conversation, now + self.seconds)
        hold = self.holds.get(node)
        if hold is not None:
            hold.taken, hold.deadline = now, now + self.seconds
            return
        if not self.returning():
            return
        if self.limit and self.starving and now - chain > self.limit:
            self.limited += 1
            return
        self.taken += 1
        self.holds[node] = Hold(self.tree.lock(node), conversation, now, now + self.seconds,
                                self.serial, chain)

    def release(self, node: Any) -> None:
        hold = self.holds.pop(node)
        self.tree.unlock(hold.lock)

    def sweep(self, waiting: Iterable[Any] = ()) -> None:
        """Count the conversations that came back and those whose time is up; renew holds that
        waiting requests continue (and mark those requests with their holds' chains); end holds
        whose time is up; say whether a request that continues no hold is starving.

        A request is judged once, by the sweep that first sees it: which finished conversations
        it returns (a request waiting before a conversation finished is not its next turn: a
        client sends that after the answer), and which held conversation it continues (its
        hold is taken by then, for the same reason). Later sweeps cost one lookup a request."""
        now = self.clock()
        for serial, done in list(self.finished.items()):
            if done.deadline <= now:
                del self.finished[serial]
                self.outcomes.append(False)
        seen, self._waiting = self._waiting, {}
        starving = False
        for req in waiting:
            entry = seen.get(req.rid)
            if entry is None:
                self._returns(req)
                entry = Waiting(now, self._find_hold(req))
            self._waiting[req.rid] = entry
            node = self._node(entry.hold)
            if node is None:
                starving = starving or now - entry.since > self.seconds
                continue
            hold = self.holds[node]
            hold.taken, hold.deadline = now, now + self.seconds
            setattr(req, _CHAIN, hold.chain)
        self.starving = starving
        for node, hold in list(self.holds.items()):
            if hold.deadline <= now:
                self.release(node)
                self.expired += 1

    def _returns(self, req: Any) -> None:
        """A newly seen request returns the finished conversations it continues."""
        for serial, done in list(self.finished.items()):
            if self._continues(req.origin_input_ids, done.tokens):
                del self.finished[serial]
                self.outcomes.append(True)

    def waiting_nodes(self, waiting: Iterable[Any]) -> set[Any]:
        """Held nodes whose conversation a waiting request continues."""
        return {node for req in waiting if (node := self._held_node(req)) is not None}

    def _held_node(self, req: Any) -> Any:
        """The held node whose conversation `req` continues (the longest), or None: the hold
        its first sweep found, while that hold lasts (a request no sweep has seen is matched
        now, and not remembered)."""
        entry = self._waiting.get(req.rid)
        return self._node(entry.hold if entry is not None else self._find_hold(req))

    def _node(self, found: tuple[Any, int] | None) -> Any:
        """The node of a hold found earlier, while that hold lasts (a released node's id may
        come back for another conversation: its number tells them apart)."""
        if found is None:
            return None
        hold = self.holds.get(found[0])
        return found[0] if hold is not None and hold.serial == found[1] else None

    def _find_hold(self, req: Any) -> tuple[Any, int] | None:
        """(node, serial) of the longest held conversation `req` continues, or None."""
        best, best_len = None, 0
        for node, hold in self.holds.items():
            if len(hold.tokens) > best_len and self._continues(req.origin_input_ids, hold.tokens):
                best, best_len = (node, hold.serial), len(hold.tokens)
        return best

    def _continues(self, prompt: Any, tokens: array) -> bool:
        """Whether `prompt` continues the conversation `tokens`: it starts with the conversation
        but for its last page (a chat template may render the end of the previous answer
        otherwise than the model wrote it). Two tokens are compared before the whole prefix,
        which rejects another conversation (whose prompt opens alike) at once."""
        n = len(tokens) - self.page_size
        return (len(prompt) >= n and prompt[n - 1] == tokens[n - 1]
                and prompt[n // 2] == tokens[n // 2] and array("q", prompt[:n]) == tokens[:n])

    def held_turns_first(self, waiting: list[Any]) -> None:
        """Order the waiting queue (in place, stably) so that requests that continue a held
        conversation come first: under first-come-first-served a new session at the head, whose
        room the holds keep, would otherwise stop admission for the turns behind it. (SGLang's
        policy may sort again: lpm puts them first anyway, priorities stay first.)"""
        if self.holds:
            waiting.sort(key=lambda req: self._held_node(req) is None)

    def relieve(self, waiting: Iterable[Any] = ()) -> bool:
        """Under memory pressure, end the oldest hold that no waiting request continues and that
        is past the first half of its time, else the oldest of the others (counted); False if
        there is none. A hold taken a moment ago is never first: the scheduler passes between a
        turn's end and its next turn's arrival."""
        if not self.holds:
            return False
        now = self.clock()
        matched = self.waiting_nodes(waiting)

        def kept(node: Any) -> bool:
            return node in matched or now - self.holds[node].taken < self.seconds / 2

        self.release(min(self.holds, key=lambda n: (kept(n), self.holds[n].taken)))
        self.released_under_pressure += 1
        return True

    def log_now_and_then(self, every: float = 60.0) -> None:
        """One info line a minute while holds are in use: what they did since the start."""
        now = self.clock()
        if self.serial and now - self._logged >= every:
            self._logged = now
            logger.info("History holds: %d of the latest %d finished conversations came back; "
                        "%d held, %d of %d taken, %d expired, %d ended under memory pressure, "
                        "%d not held again for waiting requests (--ragged-hold-limit)",
                        sum(self.outcomes), len(self.outcomes), len(self.holds), self.taken,
                        self.serial, self.expired, self.released_under_pressure, self.limited)

    def clear(self) -> None:
        """Forget every hold without unlocking: the tree was reset under them (what came back
        before stays known)."""
        self.holds.clear()


def holds_of(tree: Any) -> HistoryHolds | None:
    """The tree's holds, created on first use where --ragged-hold-history is above 0 (a tree
    without them remembers that: the environment is read once per tree)."""
    if _ATTR not in tree.__dict__:
        seconds = hold_seconds()
        holds = None
        if seconds > 0 and not getattr(tree, "disable", False):
            holds = HistoryHolds(tree, seconds, getattr(tree, "page_size", 1), limit=hold_limit())
            logger.info("Holding finished requests' histories for %g s while conversations come "
                        "back (--ragged-hold-history)", seconds)
        tree.__dict__[_ATTR] = holds
    return tree.__dict__[_ATTR]


def _existing(tree: Any) -> HistoryHolds | None:
    return None if tree is None else tree.__dict__.get(_ATTR)


# ---- hooks (serving/plugin.py) ------------------------------------------------------------------


def after_checkpoint(result: Any, tree: Any, req: Any, *args: Any, up_to: int, **kwargs: Any) -> None:
    """AFTER the radix cache's checkpoint(req, up_to): a finished request's conversation is in
    the tree and `req.last_node` ends it (release_kv_cache drops the request's own lock next)."""
    if not req.finished() or _aborted(req):
        return
    holds = holds_of(tree)
    if holds is not None:
        holds.take(req.last_node, req.full_untruncated_fill_ids[:up_to], getattr(req, _CHAIN, None))


def after_reset(result: Any, tree: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER the radix cache's reset (flush_cache): the held nodes are gone with the tree."""
    holds = _existing(tree)
    if holds is not None:
        holds.clear()


def around_get_new_batch_prefill(original: Any, scheduler: Any, running_batch: Any, *args: Any,
                                 **kwargs: Any) -> Any:
    """AROUND Scheduler.get_new_batch_prefill: sweep the holds and put the waiting turns of held
    conversations first; if then nothing runs and nothing waiting could be admitted, end holds
    (unmatched, oldest first) until something is."""
    holds = _existing(scheduler.tree_cache)
    if holds is None:
        return original(scheduler, running_batch, *args, **kwargs)
    waiting = scheduler.waiting_queue
    holds.sweep(waiting)
    holds.held_turns_first(waiting)
    holds.log_now_and_then()
    plan = original(scheduler, running_batch, *args, **kwargs)
    while (plan.batch_to_run is None and plan.running_batch.is_empty() and waiting
           and scheduler.chunked_req is None and holds.relieve(waiting)):
        plan = original(scheduler, plan.running_batch, *args, **kwargs)
    return plan


def around_check_decode_mem(original: Any, batch: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ScheduleBatch.check_decode_mem: end holds (oldest first) before SGLang retracts a
    running request for room."""
    fits = original(batch, *args, **kwargs)
    holds = None if fits else _existing(batch.tree_cache)
    while not fits and holds is not None and holds.relieve():
        fits = original(batch, *args, **kwargs)
    return fits


def _aborted(req: Any) -> bool:
    reason = getattr(req, "finished_reason", None)
    return type(reason).__name__ == "FINISH_ABORT"
