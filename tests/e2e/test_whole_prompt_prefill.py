"""`--chunked-prefill-size -1`: no chunking, every prompt is prefilled in one extend forward
(its complete pages but the window sealed at once), on a twin of the shared server. On a CPU
SGLang then derives a negative `--mem-fraction-static` and refuses to start, stock backends too
(docs: DEVELOPERS.md), so the twin passes one; `--max-total-tokens` still sizes its pool."""

from __future__ import annotations

import pytest

from bench import counters
from tests.e2e.conftest import _start, post
from tests.e2e.test_scheduler_features import _answer, _prefill_tokens
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

LONG = ("Whole prompt check. " + " ".join([FACTS] * 4)
        + "\nQuestion: what is the code of item 7? Answer:")
SHORT = "Whole prompt check: name the three primary colors."


@pytest.fixture(scope="module")
def whole_server(request, ragged_server):
    args = list(ragged_server.args)
    args[args.index("--chunked-prefill-size") + 1] = "-1"
    return _start(request, [*args, "--mem-fraction-static", "0.3"], "ragged-whole-prompt")


def test_a_prompt_within_one_chunk_answers_as_on_the_chunking_server(ragged_server, whole_server):
    """A prompt shorter than the shared server's chunk is one extend there too: the same rows,
    the same answer."""
    want = _answer(ragged_server.base_url, SHORT, 32, timeout=600)
    got = _answer(whole_server.base_url, SHORT, 32, timeout=600)
    assert got["text"] == want["text"] and got["cached_tokens"] == want["cached_tokens"] == 0


def test_a_long_prompt_is_one_extend_and_its_history_is_reused(whole_server):
    base = whole_server.base_url
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    ids = post(base, "/tokenize", {"prompt": LONG})["tokens"]
    batches = len(_prefill_tokens(whole_server))
    first = _answer(base, LONG, 16, timeout=600)
    assert first["finish_reason"]["type"] == "length" and first["completion_tokens"] == 16, first
    assert _prefill_tokens(whole_server)[batches:] == [len(ids)]
    # the next turn reads the first one's sealed pages from the tree
    turn = _answer(base, LONG + first["text"] + " And of item 30? Answer:", 16, timeout=600)
    assert turn["cached_tokens"] >= len(ids) // 64 * 64 - 64, turn
    assert turn["completion_tokens"] == 16
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens
