"""--ragged-hold-history on a served ragged pool: a conversation's history outlives a new
session's prompt that would evict it, the new session is still served, and nothing leaks.

The server's pool (2304 logical tokens) holds a decoding request, one 900-token conversation
and a bit more; a new 1500-token prompt fits only if that conversation's pages are evicted. A
fresh server holds finished conversations: the new prompt waits, the conversation's next turn is
admitted first and finds its whole history cached. Once single requests have shown that
conversations do not come back, the server stops holding, and the same sequence evicts the
history (the next turn prefills it again), as SGLang's own admission does. Every forward runs
the pool's integrity check.

The second time, the turn is sent only once the new session's request has finished: a turn sent
while that prompt is still being prefilled in chunks can be admitted before the chunk that would
evict its history (a race on a loaded machine, not a hold). That the new session was not held is
shown by its finishing before the decoding request: a hold would keep it waiting until that
request finished (nothing else frees room) or until the hold's time, longer than the decode.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import COMMON, PAGE, _start, post, post_raw

pytestmark = pytest.mark.e2e

HOLD_SECONDS = 30  # longer than the busy request's 320-token decode


@pytest.fixture(scope="module")
def held_server(request, model_path):
    from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE
    from tests.e2e.conftest import REPO

    return _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                            "--ragged-profile", str(REPO / DEFAULT_PROFILE),
                            "--ragged-precision", DEFAULT_PRECISION, "--max-total-tokens", "2304",
                            "--max-running-requests", "4",
                            "--ragged-hold-history", str(HOLD_SECONDS)], "held")


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _generate(base_url: str, ids: list[int], tokens: int) -> dict:
    out = post(base_url, "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 0}}, timeout=600)
    return {"ids": out["output_ids"], **out["meta_info"], "done_at": time.monotonic()}


def _turns(base_url: str, seed: int, second_after_new: bool) -> tuple[dict, dict, dict, dict]:
    """A conversation's turn 1 (900 tokens); then a request that decodes 320 tokens (the server
    stays busy); 1.5 s later a new session's 1500-token prompt; then the conversation's turn 2
    (its history and 40 new tokens): a second after the new session's request was sent, or once
    it has finished."""
    history = _ids(seed, 900)
    first = _generate(base_url, history, 4)
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(_generate, base_url, _ids(seed + 1, 64), 320)
        time.sleep(1.5)
        new = pool.submit(_generate, base_url, _ids(seed + 2, 1500), 4)
        if second_after_new:
            new.result()
        else:
            time.sleep(1)
        second = _generate(base_url, history + first["ids"] + _ids(seed + 3, 40), 4)
        return first, second, new.result(), busy.result()


def test_a_held_history_outlives_a_new_session_that_would_evict_it(held_server):
    base = held_server.base_url
    history = 900 // PAGE * PAGE  # the tree keeps whole pages

    # A fresh server holds (nothing says conversations do not come back): the new session
    # waits and the turn finds its history cached.
    first, second, new, busy = _turns(base, 20, second_after_new=False)
    assert second["cached_tokens"] >= history, (first, second)
    assert new["completion_tokens"] == 4 and busy["completion_tokens"] == 320
    assert new["e2e_latency"] > second["e2e_latency"] + 1  # sent a second before, done after

    # Single requests that nobody continues, past the hold time: conversations do not come
    # back, so the server stops holding (the holds above have ended too).
    for seed in range(8):
        _generate(base, _ids(100 + seed, 2 * PAGE + 2), 2)
    time.sleep(HOLD_SECONDS + 1.0)

    # Now the new session's prompt evicts the history as SGLang's own admission does (on an
    # emptied tree, as the first time: nothing older to evict first; the flush keeps what the
    # server learnt of returns), and the next turn prefills it again.
    post_raw(base, "/flush_cache", {})
    first, second, new, busy = _turns(base, 30, second_after_new=True)
    assert new["done_at"] < busy["done_at"], (new, busy)  # admitted at once, not held
    assert second["cached_tokens"] < history, (first, second)  # its last pages went
    assert new["completion_tokens"] == 4 and busy["completion_tokens"] == 320

    health = post(base, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert health["meta_info"]["completion_tokens"] == 2
