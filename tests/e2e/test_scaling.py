"""Serving beyond one scheduler: two ragged workers behind SGLang's router (cache-aware routing
keeps every session's later turns on the worker holding its compressed history) and SGLang's
in-process data parallelism (--dp-size 2), each rank with its own ragged pool."""

from __future__ import annotations

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sgl_ragged.testing.router import RouterDeployment
from tests.e2e.conftest import COMMON, INTEGRITY_ENV, _start, cpu_bind, get, post

pytestmark = pytest.mark.e2e

SESSIONS, TURNS = 4, 3
WORDS = "alpha river stone maple copper violet orbit lantern harbor meadow ember quartz".split()


def _context(session: int) -> str:
    """~450 tokens of text unique to a session (several 64-token pages)."""
    rng = random.Random(session)
    notes = " ".join(f"Note {i}: the {rng.choice(WORDS)} code is {rng.randrange(10**5)}."
                     for i in range(40))
    return f"Session {session}. Remember these notes. {notes}"


def _chat(base_url: str, messages: list[dict]) -> dict:
    # Four sessions share two cores here: a request can wait behind three others' prefills.
    return post(base_url, "/v1/chat/completions", {
        "model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}, timeout=600)


def _run_sessions(base_url: str, turns: int = TURNS) -> dict[int, list[int]]:
    """SESSIONS sessions of `turns` turns, run side by side; cached prompt tokens per turn."""
    def session(s: int) -> list[int]:
        messages: list[dict] = [{"role": "system", "content": _context(s)}]
        cached = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn}: what is note {turn}?"})
            out = _chat(base_url, messages)
            cached.append(int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        return cached

    with ThreadPoolExecutor(SESSIONS) as pool:
        return dict(enumerate(pool.map(session, range(SESSIONS))))


def _prompt_tokens(base_url: str) -> float:
    """The worker's sglang:prompt_tokens_total (summed over label sets)."""
    text = get(base_url, "/metrics")
    return sum(float(m) for m in re.findall(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def router_deployment(model_path: str):
    args = ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
            "--ragged-profile", "uniform:0.3", "--max-total-tokens", "4096",
            "--max-running-requests", "4", "--enable-metrics"]
    log_dir = Path(os.environ.get("RAGGED_TEST_LOGS", "/tmp/sgl-ragged-test-logs")) / "router"
    with RouterDeployment(args, num_workers=2, policy="cache_aware", log_dir=log_dir,
                          env=INTEGRITY_ENV) as deployment:
        yield deployment


def test_cache_aware_router_keeps_later_turns_on_their_history(router_deployment):
    before = [_prompt_tokens(w.base_url) for w in router_deployment.workers]
    cached = _run_sessions(router_deployment.base_url)
    after = [_prompt_tokens(w.base_url) for w in router_deployment.workers]
    # Both workers served sessions (the router spread them), ...
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    # ... and every later turn of every session found its compressed history cached.
    for s, per_turn in cached.items():
        assert all(c >= 64 for c in per_turn[1:]), f"session {s}: cached tokens per turn {per_turn}"
    for w in router_deployment.workers:  # integrity checks ran on every forward and held
        assert w.proc is not None and w.proc.poll() is None
        assert "Ragged KV cache:" in w.log_text()


@pytest.fixture(scope="module")
def dp_server(request: pytest.FixtureRequest, model_path: str):
    return _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                            "--ragged-profile", "uniform:0.3", "--max-total-tokens", "4096",
                            "--max-running-requests", "4", "--dp-size", "2"], "dp2",
                  env={"SGLANG_CPU_OMP_THREADS_BIND": cpu_bind(2)})


def test_dp_size_2_serves_with_a_pool_per_rank(dp_server):
    # Two turns: round-robin ignores where a session's history lives, so later turns often
    # prefill it again on the other rank, one core each (three turns took 325-380 s in CI).
    cached = _run_sessions(dp_server.base_url, turns=2)
    assert all(len(turns) == 2 for turns in cached.values())
    log = dp_server.log_text()
    # Two schedulers each built their own ragged pool and staging (one log line each).
    assert log.count("Ragged KV cache:") == 2, log[-3000:]
    # RAGGED_CHECK_INTEGRITY=1: a violated pool invariant kills its scheduler; both still serve.
    out = _chat(dp_server.base_url, [{"role": "user", "content": "Say OK."}])
    assert out["choices"][0]["message"]["content"] is not None
