"""Serving through the ragged backend: OpenAI API, /generate, streaming, concurrency,
multi-turn prefix hits, memory pressure, abort, malformed requests."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import counters
from sgl_ragged.models.smollm2 import README_QUESTION
from tests.e2e.conftest import get, post, stream_lines

pytestmark = pytest.mark.e2e

FACTS = " ".join(f"The code of item {i} is {1000 + 37 * i}." for i in range(40))


def _chat(base_url: str, messages: list[dict], max_tokens: int = 24) -> dict:
    return post(base_url, "/v1/chat/completions", {
        "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
    })


def test_startup_log_reports_compression(ragged_server):
    log = ragged_server.log_text()
    assert "Ragged KV cache:" in log and "retention 0.3" in log and "capacity gain" in log


def test_a_cpu_server_forks_its_children(ragged_server):
    """compat/cpu_start.py: the launcher forks its scheduler and detokenizer (no second import
    of SGLang in each); every other test of this server shows they serve."""
    log = ragged_server.log_text()
    for launch in ("_launch_scheduler_processes", "_launch_detokenizer_subprocesses"):
        assert f"{launch}: child processes start by fork (a CPU server's launcher)" in log


def test_the_scheduler_loads_its_tokenizer_once(ragged_server):
    """compat/shared_tokenizer.py: the model worker's identical load is shared, not repeated."""
    assert "Scheduler: 1 of 2 get_tokenizer calls shared an earlier load" in ragged_server.log_text()


def test_chat_completion_answers(ragged_server):
    out = _chat(ragged_server.base_url, [{"role": "user", "content": README_QUESTION}])
    text = out["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert out["usage"]["completion_tokens"] > 0


def test_parallel_sampling_n_choices(ragged_server):
    """OpenAI `n` > 1: SGLang forks the prompt into n requests sharing its cached prefix pages;
    each choice is a full answer (the integrity check runs on every forward of this server)."""
    out = post(ragged_server.base_url, "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": README_QUESTION}],
        "max_tokens": 16, "temperature": 0.9, "n": 3})
    choices = out["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    assert all(c["message"]["content"].strip() for c in choices), choices
    assert out["usage"]["completion_tokens"] >= 3


ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                 "properties": {"city": {"type": "string", "maxLength": 24},
                                "country": {"type": "string", "enum": ["France", "Italy", "Spain"]}}}


def test_structured_outputs_follow_their_grammar(ragged_server):
    """Constrained decoding (SGLang's grammar backend, xgrammar) masks the logits the ragged
    backend's attention produced: an OpenAI `json_schema` answer parses and fits its schema,
    a `/generate` regex and an EBNF grammar are matched whole, greedy and sampled."""
    base = ragged_server.base_url
    for temperature in (0, 0.8):
        out = post(base, "/v1/chat/completions", {
            "model": "default", "max_tokens": 64, "temperature": temperature,
            "messages": [{"role": "user", "content": "Where is the Eiffel tower? Answer as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "place", "schema": ANSWER_SCHEMA}}})
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        answer = json.loads(choice["message"]["content"])
        assert set(answer) == {"city", "country"} and answer["country"] in ("France", "Italy", "Spain")
        assert isinstance(answer["city"], str) and len(answer["city"]) <= 24
        for constraint, whole in (({"regex": "(19|20)[0-9]{2}"}, r"(19|20)[0-9]{2}"),
                                  ({"ebnf": 'root ::= "yes" | "no"'}, r"yes|no")):
            got = post(base, "/generate", {
                "text": "The year the Eiffel tower was finished, in digits:",
                "sampling_params": {"max_new_tokens": 8, "temperature": temperature, **constraint}})
            assert re.fullmatch(whole, got["text"]), (constraint, got["text"])
            assert got["meta_info"]["finish_reason"]["type"] == "stop", got["meta_info"]


def test_generate_and_stream_agree(ragged_server):
    payload = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    full = post(ragged_server.base_url, "/generate", payload)["text"]
    chunks = [json.loads(line) for line in stream_lines(ragged_server.base_url, "/generate",
                                                         {**payload, "stream": True}) if line != "[DONE]"]
    assert chunks and chunks[-1]["text"] == full


def test_openai_streaming(ragged_server):
    payload = {"model": "default", "messages": [{"role": "user", "content": "Count to five."}],
               "max_tokens": 16, "temperature": 0, "stream": True}
    pieces = []
    for line in stream_lines(ragged_server.base_url, "/v1/chat/completions", payload):
        if line == "[DONE]":
            break
        delta = json.loads(line)["choices"][0]["delta"]
        pieces.append(delta.get("content") or "")
    assert "".join(pieces).strip()


def test_multi_turn_hits_prefix_cache(ragged_server):
    """Turn 2 re-sends turn 1 (prompt + answer): its sealed pages must come from the tree."""
    messages = [{"role": "user", "content": f"{FACTS}\nWhat is the code of item 3?"}]
    first = _chat(ragged_server.base_url, messages)
    messages += [first["choices"][0]["message"],
                 {"role": "user", "content": "And the code of item 7?"}]
    second = _chat(ragged_server.base_url, messages)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // 64 * 64 - 64
    assert cached % 64 == 0


def test_concurrent_sessions(ragged_server):
    """Several users at once, each with two turns; every answer is produced."""
    def session(i: int) -> int:
        msgs = [{"role": "user", "content": f"{FACTS[: 400 + 50 * i]}\nSay hello to user {i}."}]
        out = _chat(ragged_server.base_url, msgs, max_tokens=12)
        msgs += [out["choices"][0]["message"], {"role": "user", "content": "Thanks!"}]
        out2 = _chat(ragged_server.base_url, msgs, max_tokens=12)
        return out2["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ThreadPoolExecutor(6) as pool:
        cached = list(pool.map(session, range(6)))
    assert all(c > 0 for c in cached)


def test_memory_pressure_evicts_and_retracts(ragged_server):
    """More decode than the 4096-token pool holds: admission reserves 0.21 of each request's
    max_new_tokens (the fixture's --schedule-conservativeness), so 8 requests of ~100 + 512
    tokens (2 + 2 pages reserved, 10 needed each: 80 > 64 pages) all start and decode must
    retract; the radix cache evicts what earlier tests left. The server's counters say so, every
    request finishes and the pool stays intact. The requests run to their length through
    `min_new_tokens`, not `ignore_eos`: SGLang reserves the whole max_new_tokens of an
    ignore_eos request at admission (PrefillAdder), which admitted only 6 of the 8 and never
    ran the pool out."""
    base = ragged_server.base_url
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    prompts = [f"Story {i}: " + FACTS[:200] for i in range(8)]

    def run(p: str) -> str:
        return post(base, "/generate", {
            "text": p, "sampling_params": {"max_new_tokens": 512, "min_new_tokens": 512, "temperature": 0},
        }, timeout=900)["meta_info"]["finish_reason"]["type"]

    with ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(run, prompts))
    assert reasons == ["length"] * 8
    done = counters.delta(before, counters.counters(base))
    assert done["evicted_tokens"] > 0 and done["retracted"] > 0, done
    assert done["integrity_checks"] > 0 and done["integrity_violations"] == 0, done
    assert idle.max_total_tokens <= 4096
    assert counters.wait_idle(base, idle.used_tokens).free_tokens == idle.free_tokens
    out = _chat(base, [{"role": "user", "content": "Say yes."}], max_tokens=4)
    assert out["choices"][0]["message"]["content"] is not None


def test_abort_midstream_keeps_serving(ragged_server):
    """A client that disconnects mid-stream aborts its request: the server counts the abort and
    the request's pages come back (free tokens return to the idle value)."""
    base = ragged_server.base_url
    idle = counters.wait_idle(base)
    before = counters.counters(base)
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"text": FACTS, "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data:" not in received:  # the first token arrived: the request holds pages
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the stream: {received!r}"
            received += chunk
        assert counters.pool_state(base).used_tokens > idle.used_tokens
    after = counters.wait_idle(base, idle.used_tokens)
    assert after.free_tokens == idle.free_tokens, after
    assert counters.delta(before, counters.counters(base))["aborted"] == 1
    out = _chat(base, [{"role": "user", "content": "Say yes."}], max_tokens=4)
    assert out["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("body", [b"{not json", json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": -5}}).encode()])
def test_malformed_request_gets_4xx(ragged_server, body):
    req = urllib.request.Request(ragged_server.base_url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert 400 <= err.value.code < 500
    out = _chat(ragged_server.base_url, [{"role": "user", "content": "Say yes."}], max_tokens=4)
    assert out["choices"][0]["message"]["content"] is not None


def test_metrics_endpoint_has_ragged_counters(ragged_server):
    """/metrics carries the plugin's counters, and a fresh prompt's sealed pages add to them."""
    base = ragged_server.base_url
    before = counters.counters(base)
    unique = " ".join(f"Entry {i} of list {id(before)} is {7 * i}." for i in range(60))
    out = _chat(base, [{"role": "user", "content": unique}], max_tokens=8)
    grew = counters.delta(before, counters.counters(base))
    pages = out["usage"]["prompt_tokens"] // 64 - 1  # all but the window page are sealed
    assert grew["pages_sealed"] >= pages >= 2, grew
    assert "sglang:ragged_staging_pages_used" in get(base, "/metrics")
