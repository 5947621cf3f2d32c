"""SGLang's mixed chunks (`--enable-mixed-chunk`) and `/flush_cache` with the ragged backend.

With mixed chunks a prefill chunk runs in the same forward as the running requests' decode
tokens, which take places of the chunk: its chunks end where the decode batch leaves them, not on
page boundaries (the backend stages a chunk's partial last page like any other). The twin of the
shared server with the flag must give each request the tokens the shared server gives it alone.
`/flush_cache` empties the twin's radix tree and storage: a repeated prompt is then prefilled
again, with the same answer. The twin is this module's own server, so flushing it disturbs no
other module's cached tokens.
"""

from __future__ import annotations

import json
import re
import threading

import pytest

from tests.e2e.conftest import _start, get, post, stream_lines
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

# Its own first words: no other test's pages of FACTS may be reused from the shared tree.
LONG = "Mixed chunk check. " + FACTS + "\nQuestion: what is the code of item 21? Answer:"
SHORT = "Mixed chunk check: count from one to thirty in words, separated by commas."


@pytest.fixture(scope="module")
def mixed_server(request, ragged_server):
    """The shared server's twin (the same arguments) with mixed chunks."""
    return _start(request, [*ragged_server.args, "--enable-mixed-chunk"], "ragged-mixed-chunk")


def _generate(base_url: str, text: str, tokens: int) -> tuple[str, int]:
    """Greedy output (decoded to its length) and the cached prompt tokens."""
    out = post(base_url, "/generate", {
        "text": text, "sampling_params": {"max_new_tokens": tokens, "min_new_tokens": tokens,
                                          "temperature": 0}})
    return out["text"], out["meta_info"]["cached_tokens"]


def _streamed(base_url: str, text: str, tokens: int, decoding: threading.Event) -> str:
    """The same request streamed; `decoding` is set once a few tokens came back."""
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
            "long": _generate(ragged_server.base_url, LONG, 16)[0]}


def test_mixed_chunks_give_each_request_its_tokens_alone(alone, mixed_server):
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
    assert got == alone
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
