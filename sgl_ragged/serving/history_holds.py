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

Off by default (`seconds` 0). Every server of the environment reads it (stock SGLang too, for
like-for-like comparisons); a scheduler keeps its holds on its own tree, and the flag is refused
with --tp-size or --pp-size above 1, whose ranks must make the same scheduling decisions and
would each read their own clock.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ENV = "RAGGED_HOLD_HISTORY"
_ATTR = "_ragged_history_holds"


def hold_seconds(environ: dict[str, str] | None = None) -> float:
    """--ragged-hold-history as seconds (0: off); a clear error for anything else."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"--ragged-hold-history expects seconds (e.g. 10, or 0 for off), got {value!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"--ragged-hold-history expects a finite number of seconds >= 0, got {value!r}")
    return seconds


@dataclass
class Hold:
    lock: Any  # the tree's TreeLock on the node
    tokens: array  # the conversation's tokens the node ends (whole pages)
    taken: float  # when it was taken or last renewed (release order under pressure)
    deadline: float
    serial: int  # this hold's number (a released node's id may come back for another one)


class HistoryHolds:
    """The holds of one radix tree. Nodes are whatever the tree's `lock` takes (SGLang's Python
    RadixCache's nodes, or the Rust tree core's opaque node ids), so a waiting request is matched
    to a hold by its tokens, not by walking the tree. `clock` is injectable for tests."""

    def __init__(self, tree: Any, seconds: float, page_size: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.tree = tree
        self.seconds = seconds
        self.page_size = max(1, page_size)
        self.clock = clock
        self.holds: dict[Any, Hold] = {}  # node -> its hold
        self._matches: dict[tuple[Any, int], bool] = {}  # (request id, hold serial) -> continues it
        self.taken = 0  # counters (tests, logs)
        self.released_under_pressure = 0
        self.expired = 0
        self._logged = float("-inf")

    # ---- taking and ending holds ------------------------------------------------------------

    def take(self, node: Any, tokens: Any) -> None:
        """Hold `node`, which ends the conversation `tokens` (a finished request's), for
        `seconds` from now. Conversations shorter than two pages are not held."""
        length = len(tokens) // self.page_size * self.page_size
        if node is None or length < 2 * self.page_size:
            return
        now = self.clock()
        hold = self.holds.get(node)
        if hold is not None:
            hold.taken, hold.deadline = now, now + self.seconds
            return
        self.taken += 1
        self.holds[node] = Hold(self.tree.lock(node), array("q", tokens[:length]), now,
                                now + self.seconds, self.taken)

    def release(self, node: Any) -> None:
        hold = self.holds.pop(node)
        self.tree.unlock(hold.lock)

    def sweep(self, waiting: Iterable[Any] = ()) -> None:
        """Renew holds that waiting requests continue; end those whose time is up."""
        now = self.clock()
        waiting = list(waiting)
        for node in self.waiting_nodes(waiting):
            self.holds[node].taken, self.holds[node].deadline = now, now + self.seconds
        for node, hold in list(self.holds.items()):
            if hold.deadline <= now:
                self.release(node)
                self.expired += 1
        rids, serials = {req.rid for req in waiting}, {hold.serial for hold in self.holds.values()}
        self._matches = {k: v for k, v in self._matches.items() if k[0] in rids and k[1] in serials}

    def waiting_nodes(self, waiting: Iterable[Any]) -> set[Any]:
        """Held nodes whose conversation a waiting request continues."""
        return {node for req in waiting if (node := self._held_node(req)) is not None}

    def _held_node(self, req: Any) -> Any:
        """The held node whose conversation `req` continues (the longest), or None. Its prompt
        must start with the conversation but for its last page: a chat template may render the
        end of the previous answer otherwise than the model wrote it."""
        best, best_len = None, 0
        for node, hold in self.holds.items():
            key = (req.rid, hold.serial)
            if key not in self._matches:
                n = len(hold.tokens) - self.page_size
                prompt = req.origin_input_ids
                self._matches[key] = len(prompt) >= n and array("q", prompt[:n]) == hold.tokens[:n]
            if self._matches[key] and len(hold.tokens) > best_len:
                best, best_len = node, len(hold.tokens)
        return best

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
        if self.taken and now - self._logged >= every:
            self._logged = now
            logger.info("History holds: %d held, %d taken, %d expired, %d ended under memory "
                        "pressure", len(self.holds), self.taken, self.expired,
                        self.released_under_pressure)

    def clear(self) -> None:
        """Forget every hold without unlocking: the tree was reset under them."""
        self.holds.clear()
        self._matches.clear()


def holds_of(tree: Any) -> HistoryHolds | None:
    """The tree's holds, created on first use where --ragged-hold-history is above 0."""
    holds = tree.__dict__.get(_ATTR)
    if holds is None:
        seconds = hold_seconds()
        if seconds <= 0 or getattr(tree, "disable", False):
            return None
        holds = HistoryHolds(tree, seconds, getattr(tree, "page_size", 1))
        tree.__dict__[_ATTR] = holds
        logger.info("Holding each finished request's history for %g s (--ragged-hold-history)", seconds)
    return holds


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
        holds.take(req.last_node, req.full_untruncated_fill_ids[:up_to])


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
