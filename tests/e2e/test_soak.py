"""The fault soak (bench/soak.py), short: sessions whose clients hang up at random points of the
stream, on the session's small-pool server with the integrity check after every forward."""

from __future__ import annotations

import pytest

from bench.soak import SoakConfig, markdown, run_soak

pytestmark = pytest.mark.e2e


def test_short_soak_leaves_the_server_intact(ragged_server):
    cfg = SoakConfig(sessions=8, turns=2, concurrency=6, context_tokens=500, max_tokens=48,
                     abort_prob=0.6, seed=1)
    report = run_soak(ragged_server.base_url, cfg)
    print(markdown(report))
    server, client = report["server"], report["client"]
    assert report["problems"] == []  # integrity checks ran, no violation, free tokens back to idle
    assert client["sent"] == cfg.sessions * cfg.turns and client["aborted"] > 0
    assert server["requests"] == client["sent"]  # every request reached an end in the server
    assert 0 < server["aborted"] <= client["aborted"]  # hang-ups the server saw mid-request
    assert server["evicted_tokens"] > 0  # the pool was too small for the sessions' history
    assert "Paris" in report["answer_after"]
