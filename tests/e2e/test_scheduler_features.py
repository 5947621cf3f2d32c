"""SGLang scheduler features on a twin of the shared server: mixed chunks, `/flush_cache`,
sessions, priority preemption, weight updates, pausing generation and aborting requests.

With mixed chunks (`--enable-mixed-chunk`) a prefill chunk runs in the same forward as the
running requests' decode tokens, which take places of the chunk: its chunks end where the decode
batch leaves them, not on page boundaries (the backend stages a chunk's partial last page like
any other). A request decoding beside them must get the tokens the shared server gives it alone.
`/flush_cache` empties the twin's radix tree and storage: a prompt is then prefilled afresh,
with its first fresh answer. Sessions (`/open_session`): a non-streaming session's turn is its
history plus the new tokens through the radix tree, so it answers as the same ids sent as one
plain request to the shared server; a streaming session (`--enable-streaming-session`) keeps
its whole history in its request row between turns, the staged window pages too, so a later
turn reuses every token of it. With `--enable-priority-scheduling` a request of a much higher
priority that finds every request row taken preempts a running one: SGLang releases its KV row
as for a retraction (its staged pages with it) and serves it again later from its prompt and
output so far. `/update_weights_from_disk` reloads the weights and flushes the tree, so later
prompts are prefilled afresh on the same pool. `/pause_generation` in place stops the
forwards and keeps every request's pages; with mode retract (an RL loop's weight update) it
releases them as a retraction does, a prompt in the middle of its chunked prefill too, and
`/continue_generation` serves the requests again. `/abort_request` ends a request by rid (a
prompt in the middle of its chunked prefill too: SGLang stops before its next chunk) or all of
them (`abort_all`), and their pages come back. The twin is this module's own server, so
flushing it disturbs no other module's cached tokens.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import counters
from tests.e2e.conftest import CHUNK, _start, get, post, post_raw, stream_lines
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

# Its own first words: no other test's pages of FACTS may be reused from the shared tree.
LONG = "Mixed chunk check. " + FACTS + "\nQuestion: what is the code of item 21? Answer:"
SHORT = "Mixed chunk check: count from one to thirty in words, separated by commas."
PAUSED_TOKENS = 320  # long enough (10 s or more here) to pause the request while it decodes


@pytest.fixture(scope="module")
def mixed_server(request, ragged_server):
    """The shared server's twin (the same arguments) with mixed chunks, streaming sessions and
    priority scheduling (requests without a priority keep their arrival order)."""
    return _start(request, [*ragged_server.args, "--enable-mixed-chunk", "--enable-streaming-session",
                            "--enable-priority-scheduling"], "ragged-twin")


def _answer(base_url: str, text: str, tokens: int, timeout: float = 300, **fields) -> dict:
    """Greedy output decoded to its length (min_new_tokens), with the request's other `fields`
    (e.g. its priority): the text and SGLang's meta_info."""
    out = post(base_url, "/generate", {
        "text": text, **fields,
        "sampling_params": {"max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 0}},
        timeout=timeout)
    return {"text": out["text"], **out["meta_info"]}


def _generate(base_url: str, text: str, tokens: int) -> tuple[str, int]:
    """Greedy output (decoded to its length) and the cached prompt tokens."""
    out = _answer(base_url, text, tokens)
    return out["text"], out["cached_tokens"]


def _streamed(base_url: str, text: str, tokens: int, decoding: threading.Event,
              progress: list[int] | None = None) -> str:
    """The same request streamed; `decoding` is set once a few tokens came back, and each
    chunk's text length goes to `progress`."""
    chunks = 0
    last = ""
    for line in stream_lines(base_url, "/generate", {
            "text": text, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "min_new_tokens": tokens,
                                "temperature": 0}}):
        if line == "[DONE]":
            break
        last = json.loads(line)["text"]  # the whole text so far
        chunks += 1
        if progress is not None:
            progress.append(len(last))
        if chunks == 4:
            decoding.set()
    decoding.set()
    return last


def _mixed_batches(server) -> list[str]:
    """The server's logged prefill batches that ran beside running (decoding) requests."""
    return [line for line in server.log_text().splitlines()
            if "Prefill batch" in line and int(re.search(r"#running-req: (\d+)", line).group(1)) > 0]


@pytest.fixture(scope="module")
def alone(ragged_server) -> dict[str, str]:
    """Each request served alone on the shared server, from a fresh prefill."""
    return {"short": _generate(ragged_server.base_url, SHORT, 96)[0],
            "long": _generate(ragged_server.base_url, LONG, 16)[0],
            "paused": _generate(ragged_server.base_url, SHORT, PAUSED_TOKENS)[0]}


def test_a_request_decoding_inside_mixed_chunks_answers_as_alone(alone, mixed_server):
    before = len(_mixed_batches(mixed_server))
    got: dict[str, str] = {}
    decoding = threading.Event()
    # the short request decodes while the long prompt is prefilled in chunks beside it
    short = threading.Thread(target=lambda: got.update(
        short=_streamed(mixed_server.base_url, SHORT, 96, decoding)))
    short.start()
    try:
        assert decoding.wait(300)
        got["long"] = _generate(mixed_server.base_url, LONG, 16)[0]
    finally:
        short.join(timeout=300)
    # The decoding request ran its tokens inside the long prompt's extend forwards: it answers
    # as alone. The long prompt's chunks ended elsewhere than alone (the decode token takes a
    # place of each), and a chunk that is not a prompt's last seals its complete pages from its
    # own queries' scores, so its answer may differ from alone by design; it is served whole.
    assert got["short"] == alone["short"]
    assert got["long"]
    assert _mixed_batches(mixed_server)[before:], "no prefill chunk ran beside a decoding request"


def test_flush_cache_empties_the_tree_and_later_requests_are_served(alone, mixed_server):
    """After a flush a prompt is prefilled afresh (no cached token) and answers as its first
    fresh prefill did; a repeat reuses its sealed pages again. (A repeat before the flush may
    answer otherwise: its cached pages were sealed by the scores of the earlier request's
    queries, a fresh prefill's by its chunks' own.)"""
    for _ in range(2):
        assert "Cache flushed" in get(mixed_server.base_url, "/flush_cache")
        text, cached = _generate(mixed_server.base_url, LONG, 16)
        assert text == alone["long"] and cached == 0
        _, cached = _generate(mixed_server.base_url, LONG, 16)
        assert cached >= 512  # the sealed prefix came from the tree


TURNS = ("Session check. " + FACTS + "\nQuestion: what is the code of item 12? Answer:",
         " And of item 30? Answer:", " And of item 5? Answer:")


def _ids(server, text: str) -> list[int]:
    return post(server.base_url, "/tokenize", {"prompt": text})["tokens"]


def _turn(server, ids: list[int], session: dict | None = None) -> tuple[list[int], int, str]:
    """Greedy output ids of 24 tokens, the cached prompt tokens and the request's id."""
    meta = post(server.base_url, "/generate", {
        "input_ids": ids, "return_logprob": True,
        **({"session_params": session} if session else {}),
        "sampling_params": {"max_new_tokens": 24, "min_new_tokens": 24, "temperature": 0},
    })["meta_info"]
    return [e[1] for e in meta["output_token_logprobs"]], meta["cached_tokens"], meta["id"]


def _session(server, streaming: bool) -> str:
    sid = post(server.base_url, "/open_session", {"capacity_of_str_len": 100000, "streaming": streaming})
    assert isinstance(sid, str) and sid, sid
    return sid


def _close(server, sid: str) -> None:
    post_raw(server.base_url, "/close_session", {"session_id": sid})


def test_a_session_turn_answers_as_its_history_sent_whole(ragged_server, mixed_server):
    turns = [_ids(mixed_server, t) for t in TURNS]
    sid, rid, history = _session(mixed_server, streaming=False), None, []
    try:
        for ids in turns:
            out, cached, rid = _turn(mixed_server, ids, {"id": sid, "rid": rid})
            history += ids
            # the same conversation as plain requests, each turn its whole history
            plain, plain_cached, _ = _turn(ragged_server, history)
            assert out == plain
            assert cached == plain_cached  # the same sealed prefix reused
            history += out
    finally:
        _close(mixed_server, sid)


def test_a_streaming_session_keeps_its_whole_history_between_turns(mixed_server):
    turns = [_ids(mixed_server, t) for t in TURNS]
    outputs = []
    for _ in range(2):  # a second session of the same turns answers the same
        assert "Cache flushed" in get(mixed_server.base_url, "/flush_cache")  # a fresh first turn
        sid, context, got = _session(mixed_server, streaming=True), 0, []
        try:
            for k, ids in enumerate(turns):
                out, cached, _ = _turn(mixed_server, ids, {"id": sid})
                # every token of the history but the last output one (not yet in the cache)
                assert cached == (context - 1 if k else 0), (k, cached, context)
                context += len(ids) + len(out)
                got.append(out)
        finally:
            _close(mixed_server, sid)
        outputs.append(got)
    assert outputs[0] == outputs[1]
    get(mixed_server.base_url, "/health")  # alive: nothing leaked at close (strict idle check)


URGENT = "Priority check: name the days of the week, separated by commas."


def test_a_high_priority_request_preempts_a_running_one(ragged_server, mixed_server):
    """Eight requests of priority 0 take the twin's eight request rows (--max-running-requests)
    and decode; one of priority 100 (above SGLang's preemption threshold of 10) then preempts
    the latest of them. It answers as alone (its prompt fits one chunk); the preempted request
    is served again to its full length; every page comes back and the pool stays intact."""
    base = mixed_server.base_url
    alone = _answer(ragged_server.base_url, URGENT, 24, priority=0)["text"]
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    with ThreadPoolExecutor(9) as pool:
        lows = [pool.submit(_answer, base, f"Priority check, request {i}. " + FACTS[:300], 160,
                             timeout=900, priority=0)
                for i in range(8)]
        deadline = time.monotonic() + 300
        while counters.pool_state(base).running < 8:
            assert time.monotonic() < deadline, "the eight requests never ran together"
            time.sleep(0.2)
        urgent = pool.submit(_answer, base, URGENT, 24, timeout=900, priority=100).result()
        lows = [f.result() for f in lows]
    assert urgent["text"] == alone and urgent["num_retractions"] == 0
    assert sorted(low["num_retractions"] for low in lows) == [0] * 7 + [1], lows
    assert all(low["finish_reason"]["type"] == "length" and low["completion_tokens"] == 160
               for low in lows)
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens


def test_weights_updated_from_disk_flush_the_tree_and_answer_as_before(mixed_server):
    """`/update_weights_from_disk` with the served checkpoint (as an RL loop does between
    steps) reloads them and empties the radix tree and the pool (the flush of `/flush_cache`):
    a prompt is then prefilled afresh and answers as its first fresh prefill did, with the pool
    intact."""
    base = mixed_server.base_url
    text = "Weights check. " + FACTS + "\nQuestion: what is the code of item 9? Answer:"
    assert "Cache flushed" in get(base, "/flush_cache")
    first, cached = _generate(base, text, 16)
    assert cached == 0
    assert _generate(base, text, 16)[1] >= 512  # its sealed prefix is in the tree
    args = mixed_server.args
    before = counters.counters(base)
    out = post(base, "/update_weights_from_disk", {"model_path": args[args.index("--model-path") + 1]})
    assert out["success"], out
    again, cached = _generate(base, text, 16)
    assert (again, cached) == (first, 0)
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done


def _prefill_tokens(server) -> list[int]:
    """The prompt tokens of each prefill batch the server logged, in order."""
    return [int(re.search(r"#new-token: (\d+)", line).group(1))
            for line in server.log_text().splitlines() if "Prefill batch" in line]


def _prefill_batches(server) -> int:
    return server.log_text().count("Prefill batch")


def _first_long_chunk(server, start: int) -> int | None:
    """The index of the first prefill batch logged after the first `start` ones that took a full
    chunk (less a token per running request, as SGLang's mixed chunks take): a long prompt's
    first chunk; None before there is one. The requests decoding beside it have shorter prompts
    (`_short_of_a_chunk`), so their prefills, even one logged late, never count as it (session
    65's CI: the fourth low request's prefill, logged after `running == 4` was seen, was taken for
    the long prompt's, and abort_all went out before the long prompt had arrived)."""
    tokens = _prefill_tokens(server)
    least = _long_chunk_tokens(server)
    return next((i for i in range(start, len(tokens)) if tokens[i] >= least), None)


def _long_chunk_tokens(server) -> int:
    """The fewest new tokens of a long prompt's chunk: a full chunk, less a token per running
    request (SGLang's mixed chunks)."""
    return CHUNK - int(server.args[server.args.index("--max-running-requests") + 1])


def _short_of_a_chunk(server, texts: list[str]) -> None:
    """Each prompt is shorter than what `_first_long_chunk` takes for a long prompt's chunk."""
    least = _long_chunk_tokens(server)
    assert all(len(_ids(server, text)) < least for text in texts), least


def _prefilled_before(server, start: int, marker: str) -> int:
    """The prompt tokens of the logged prefill batches after the first `start` ones and before
    the first line with `marker` after them."""
    tokens, seen = 0, 0
    for line in server.log_text().splitlines():
        if "Prefill batch" in line:
            seen += 1
            if seen > start:
                tokens += int(re.search(r"#new-token: (\d+)", line).group(1))
        elif seen >= start and marker in line:
            return tokens
    raise AssertionError(f"no {marker!r} in the log after prefill batch {start}")


def _wait(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_an_in_place_pause_freezes_decoding_and_resumes_on_the_same_pages(alone, mixed_server):
    """`/pause_generation` in place stops the scheduler's forwards and leaves every request
    where it is, its KV row and pages with it: the decoding request makes no progress, a
    `/flush_cache` is refused (a request holds pages), and after
    `/continue_generation` it answers as served alone, never retracted."""
    base = mixed_server.base_url
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    got: dict[str, str] = {}
    progress: list[int] = []
    decoding = threading.Event()
    short = threading.Thread(target=lambda: got.update(
        short=_streamed(base, SHORT, PAUSED_TOKENS, decoding, progress)))
    short.start()
    try:
        assert decoding.wait(300)
        assert "paused" in post_raw(base, "/pause_generation", {"mode": "in_place"})
        try:
            time.sleep(1.0)  # what a step in flight streams arrives
            frozen = len(progress)
            time.sleep(3.0)
            assert len(progress) == frozen, "the request decoded while paused"
            # (the scheduler publishes /v1/loads from the forwards' loop: stale while paused)
            with pytest.raises(urllib.error.HTTPError) as refused:
                get(base, "/flush_cache")
            assert refused.value.code == 400
        finally:
            post_raw(base, "/continue_generation", {})
    finally:
        short.join(timeout=300)
    assert len(progress) > frozen
    assert got["short"] == alone["paused"]
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens


PAUSE_LOWS = [f"Pause check, request {i}. " + FACTS[:300] for i in range(4)]
PAUSE_LONG = ("Pause check, long. " + " ".join([FACTS] * 4)
              + "\nQuestion: what is the code of item 7? Answer:")


def test_a_retracting_pause_frees_every_page_and_serves_its_requests_after_a_weight_update(
        alone, mixed_server):
    """The RL loop's weight update: `/pause_generation` with mode retract while four requests
    decode and a long prompt is being prefilled in chunks sends all five back to the queue
    (SGLang's retract_all: their KV rows, sealed and staged pages go back, the chunked prompt's
    with them), so a `/flush_cache` succeeds while paused; `/update_weights_from_disk` then
    reloads the weights and flushes the tree again with the five still queued, and after
    `/continue_generation` each is served again, from its prompt and output so far, to its full
    length. Every page comes back and the pool stays intact; a fresh prompt answers as its
    first fresh prefill did."""
    base = mixed_server.base_url
    assert "Cache flushed" in get(base, "/flush_cache")
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    args = mixed_server.args
    _short_of_a_chunk(mixed_server, PAUSE_LOWS)
    with ThreadPoolExecutor(5) as pool:
        lows = [pool.submit(_answer, base, text, 160, timeout=900) for text in PAUSE_LOWS]
        _wait(lambda: counters.pool_state(base).running == 4, "the four requests never ran together")
        prefills = _prefill_batches(mixed_server)
        long = pool.submit(_answer, base, PAUSE_LONG, 48, timeout=900)
        _wait(lambda: _first_long_chunk(mixed_server, prefills) is not None,
              "the long prompt was never prefilled")
        assert "paused" in post_raw(base, "/pause_generation", {"mode": "retract"})
        try:
            # nothing runs or is being prefilled (a flush is refused while a request holds
            # pages, as in place), and the five wait
            assert "Cache flushed" in get(base, "/flush_cache")
            out = post(base, "/update_weights_from_disk",
                       {"model_path": args[args.index("--model-path") + 1]})
            assert out["success"], out
        finally:
            post_raw(base, "/continue_generation", {})
        lows = [f.result() for f in lows]
        long = long.result()
    # the scheduler took the pause in the middle of the long prompt's chunks (the flush
    # while paused logs after the last chunk it ran)
    assert 0 < _prefilled_before(mixed_server, prefills, "Cache flushed") < len(_ids(mixed_server, PAUSE_LONG))
    for out, tokens in [*((low, 160) for low in lows), (long, 48)]:
        assert out["num_retractions"] == 1, out
        assert out["finish_reason"]["type"] == "length" and out["completion_tokens"] == tokens, out
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens
    assert _generate(base, SHORT, 96) == (alone["short"], 0)


ABORT_LONG = ("Abort check, long. " + " ".join([FACTS] * 4)
              + "\nQuestion: what is the code of item 9? Answer:")


def _finished(submitted) -> dict:
    """A submitted `_answer`'s text and meta_info, also where SGLang answered the request with an
    error status (its body carries them as well)."""
    try:
        return submitted.result()
    except urllib.error.HTTPError as error:
        out = json.loads(error.read())
        return {"text": out.get("text", ""), **out.get("meta_info", out)}


def _abort_mid_prefill(server, payload: dict, rid: str) -> tuple[dict, int]:
    """Send ABORT_LONG as `rid` and abort with `payload` once its first chunk is logged: its
    answer and the prompt tokens prefilled since it was sent."""
    base = server.base_url
    prefills = _prefill_batches(server)
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(_answer, base, ABORT_LONG, 16, timeout=900, rid=rid)
        _wait(lambda: _first_long_chunk(server, prefills) is not None,
              "the long prompt was never prefilled")
        post_raw(base, "/abort_request", payload)
        out = _finished(long)
    return out, sum(_prefill_tokens(server)[_first_long_chunk(server, prefills):])


def test_aborting_a_prompt_mid_chunked_prefill_frees_its_pages(alone, mixed_server):
    """`/abort_request` with the rid of a prompt being prefilled in chunks: SGLang stops before
    its next chunk and releases its KV row (the pages its chunks sealed and staged so far) at
    the top of a scheduling step, the chunk in flight already launched. A request decoding
    beside it answers as alone, the aborted prompt is answered as aborted, and the pool comes
    back to idle intact; the same prompt sent again is served whole (its first chunks' sealed
    pages may come from the tree: SGLang caches a chunked prompt's prefix chunk by chunk)."""
    base = mixed_server.base_url
    assert "Cache flushed" in get(base, "/flush_cache")
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    got: dict[str, str] = {}
    _short_of_a_chunk(mixed_server, [SHORT])
    decoding = threading.Event()
    short = threading.Thread(target=lambda: got.update(
        short=_streamed(base, SHORT, 96, decoding)))
    short.start()
    try:
        assert decoding.wait(300)
        aborted, prefilled = _abort_mid_prefill(mixed_server, {"rid": "abort-check-long"},
                                                "abort-check-long")
    finally:
        short.join(timeout=300)
    assert aborted["finish_reason"]["type"] == "abort" and aborted["completion_tokens"] == 0, aborted
    assert 0 < prefilled < len(_ids(mixed_server, ABORT_LONG)), prefilled
    assert got["short"] == alone["short"]
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens
    again = _answer(base, ABORT_LONG, 16)
    assert again["finish_reason"]["type"] == "length" and again["completion_tokens"] == 16, again


def test_abort_all_ends_decoding_requests_and_a_chunked_prompt_and_frees_their_pages(
        alone, mixed_server):
    """`/abort_request` with abort_all while four requests decode and a long prompt is in the
    middle of its chunked prefill: all five end as aborted, each decoding one with the tokens
    it had, every page comes back and the pool stays intact; the server then serves a prompt
    afresh as its first fresh prefill did."""
    base = mixed_server.base_url
    assert "Cache flushed" in get(base, "/flush_cache")
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    _short_of_a_chunk(mixed_server, PAUSE_LOWS)
    with ThreadPoolExecutor(4) as pool:
        lows = [pool.submit(_answer, base, text, 160, timeout=900) for text in PAUSE_LOWS]
        _wait(lambda: counters.pool_state(base).running == 4, "the four requests never ran together")
        aborted, prefilled = _abort_mid_prefill(mixed_server, {"abort_all": True},
                                                "abort-all-check-long")
        lows = [_finished(low) for low in lows]
    assert aborted["finish_reason"]["type"] == "abort" and aborted["completion_tokens"] == 0, aborted
    assert 0 < prefilled < len(_ids(mixed_server, ABORT_LONG)), prefilled
    for out in lows:
        assert out["finish_reason"]["type"] == "abort" and 0 < out["completion_tokens"] < 160, out
    done = counters.delta(before, counters.counters(base))
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens
    assert "Cache flushed" in get(base, "/flush_cache")
    assert _generate(base, SHORT, 96) == (alone["short"], 0)
