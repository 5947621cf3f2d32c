"""The frontend-language programs in examples/ against the ragged server: each produces its
answers, and the prefix its turns or branches share is served from the radix cache."""

from __future__ import annotations

import itertools

import pytest

from examples import fork_join, multi_turn_chat, select_program

pytestmark = pytest.mark.e2e
PAGE = 64


def test_multi_turn_chat(ragged_server):
    turns = multi_turn_chat.run(ragged_server.base_url)
    assert len(turns) == 3 and all(t["answer"].strip() for t in turns)
    for before, turn in itertools.pairwise(turns):  # each turn re-sends the previous prompt
        assert turn["cached_tokens"] >= before["prompt_tokens"] // PAGE * PAGE - 2 * PAGE
        assert turn["cached_tokens"] % PAGE == 0


def test_fork_join_branches_share_the_document(ragged_server):
    out = fork_join.run(ragged_server.base_url)
    assert out["summary"].strip()
    for branch in out["branches"]:
        assert branch["answer"].strip()
        # the document (its complete pages, less the window) came from the cache
        assert branch["cached_tokens"] >= branch["prompt_tokens"] // PAGE * PAGE - 2 * PAGE > 0
    # the summary shares only the document with the branches; a branch that ran after another
    # one also found that branch's question prefix cached, so compare with the least of them
    assert out["cached_tokens"] >= min(b["cached_tokens"] for b in out["branches"])


def test_select_reuses_the_cached_document(ragged_server):
    out = select_program.run(ragged_server.base_url)
    assert len(out["choices"]) == 2 and set(out["choices"]) <= set(out["options"])
    # two selects, each scoring 3 options after the ~700-token document: its pages are re-used
    assert out["cached_tokens"] >= 2 * 3 * 8 * PAGE
