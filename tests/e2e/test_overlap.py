"""SGLang's overlap scheduler with the ragged backend.

Under it the scheduler launches batch N+1 before it processes batch N's results, so a finished
request's pages are sealed (the tree checkpoint's `seal_staged`) after the next forward was
planned, and a request that ends on EOS is decoded once more in that forward. The shared
`ragged_server` runs it, as SGLang runs it by default (its other modules, the soak among them,
check integrity and leaks under it); here its outputs are held to a twin started with
`--disable-overlap-schedule`.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import _start, get, post
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def normal_loop_server(request, ragged_server):
    """The shared server's twin (the same arguments) with SGLang's normal, non-overlapped loop."""
    return _start(request, [*ragged_server.args, "--disable-overlap-schedule"], "ragged-no-overlap")


def _overlap(server) -> bool:
    return not json.loads(get(server.base_url, "/get_server_info"))["disable_overlap_schedule"]


def test_ragged_servers_run_the_overlap_scheduler(ragged_server, normal_loop_server):
    assert _overlap(ragged_server)
    assert not _overlap(normal_loop_server)


def _turns(base_url: str) -> list[tuple[list[int], int]]:
    """A three-turn conversation, greedy, each turn decoding to its length (a request that ends
    by length leaves the next batch at once under the overlap scheduler, so both loops attend
    to the same rows; one that ends on EOS decodes once more there, and that token's queries
    count in its last pages' scores). Per turn: the output ids and the cached prompt tokens."""
    # Its own first words: no other test's pages of FACTS may be reused from the shared tree.
    text, out = "Overlap check. " + FACTS + "\nQuestion: what is the code of item 12? Answer:", []
    for follow_up in (" And of item 30?", " And of item 5?", ""):
        meta = post(base_url, "/generate", {
            "text": text, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "min_new_tokens": 40, "temperature": 0},
        })
        ids = [e[1] for e in meta["meta_info"]["output_token_logprobs"]]
        out.append((ids, meta["meta_info"]["cached_tokens"]))
        text += meta["text"] + follow_up
    return out


def test_overlap_gives_the_outputs_of_the_normal_loop(ragged_server, normal_loop_server):
    """Token for token the same greedy conversation, each turn after the first reusing the
    sealed pages of the one before from the radix tree (the same number of cached tokens)."""
    overlapped, normal = _turns(ragged_server.base_url), _turns(normal_loop_server.base_url)
    assert [ids for ids, _ in overlapped] == [ids for ids, _ in normal]
    assert [c for _, c in overlapped] == [c for _, c in normal]
    assert all(c >= 512 for _, c in overlapped[1:]), overlapped
