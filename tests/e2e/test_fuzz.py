"""Property-based fuzzing of /generate and /v1/chat/completions with hypothesis-generated bodies:
whatever a client sends, the connection is answered, a 5xx never leaves the server unhealthy,
and afterwards the server is healthy and answers a normal chat."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.test_request_guard import assert_serving, send

pytestmark = pytest.mark.e2e

VOCAB = 49152


def _mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` three times in four (so bodies reach the scheduler), else `hostile`."""
    return st.one_of(valid, valid, valid, hostile)


# Integers around every boundary the server has: negative, the vocabulary, int32/int64 limits.
EDGE_INTS = st.one_of(st.integers(-3, 3), st.integers(VOCAB - 2, VOCAB + 2),
                      st.sampled_from([-(2**31), 2**31 - 1, 2**31, 2**63 - 1, 10**9]),
                      st.integers(-(2**64), 2**64))
# Parallel samples: out of range, but not so far that a server without the guard would try to
# expand them (n = 49152 once took the HTTP server's process to the OOM killer on this machine).
SAMPLES = st.one_of(st.integers(-3, 0), st.sampled_from([129, 200]))
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
TEXT = _mostly(st.text(min_size=1, max_size=40), st.one_of(st.just(""), st.text(max_size=3)))
IDS = _mostly(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
              st.lists(st.one_of(st.integers(0, VOCAB - 1), EDGE_INTS), max_size=12))
FLOAT = st.floats(-3, 3, allow_nan=False)
EDGE_FLOAT = st.one_of(FLOAT, st.sampled_from([0.0, 1e9, -1e9, 5e-324]))


def _body(required: dict | None = None, **optional: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries(required or {}, optional=optional)


def _field(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly valid, sometimes a boundary, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, hostile, ANY_JSON)


SAMPLING = _body(
    max_new_tokens=_field(st.integers(0, 4), EDGE_INTS), min_new_tokens=_field(st.integers(0, 2), EDGE_INTS),
    temperature=_field(st.floats(0, 2), EDGE_FLOAT), top_p=_field(st.floats(0.05, 1), EDGE_FLOAT),
    top_k=_field(st.one_of(st.just(-1), st.integers(1, 100)), EDGE_INTS),
    min_p=_field(st.floats(0, 1), EDGE_FLOAT), frequency_penalty=_field(st.floats(-2, 2), EDGE_FLOAT),
    presence_penalty=_field(st.floats(-2, 2), EDGE_FLOAT),
    repetition_penalty=_field(st.floats(0.5, 2), EDGE_FLOAT),
    stop=_field(st.lists(st.text(min_size=1, max_size=5), max_size=3), st.text(max_size=3)),
    stop_token_ids=_field(IDS, EDGE_INTS), ignore_eos=st.booleans(), n=_field(st.integers(1, 3), SAMPLES),
    skip_special_tokens=st.booleans(), sampling_seed=_field(st.integers(0, 2**31), EDGE_INTS),
    logit_bias=_field(st.dictionaries(st.integers(0, VOCAB - 1).map(str), FLOAT, max_size=3),
                      st.dictionaries(EDGE_INTS.map(str), EDGE_FLOAT, max_size=3)),
    regex=st.sampled_from(["[0-9]+", "(", "a|b"]),
    json_schema=st.sampled_from(['{"type": "integer"}', "{not json"]),
)
GENERATE_FIELDS = dict(
    sampling_params=st.one_of(SAMPLING, SAMPLING, st.lists(SAMPLING, max_size=3), ANY_JSON),
    stream=st.booleans(), return_logprob=st.booleans(),
    top_logprobs_num=_field(st.integers(0, 5), EDGE_INTS),
    logprob_start_len=_field(st.integers(-1, 3), EDGE_INTS), token_ids_logprob=_field(IDS, EDGE_INTS),
    return_text_in_logprobs=st.booleans(), rid=st.one_of(st.text(max_size=8), st.just("fixed-rid")),
)
GENERATE = st.one_of(
    _body({"text": TEXT}, **GENERATE_FIELDS), _body({"input_ids": IDS}, **GENERATE_FIELDS),
    _body({"text": st.lists(TEXT, max_size=3)}, **GENERATE_FIELDS),
    _body({"input_ids": st.lists(IDS, max_size=3)}, **GENERATE_FIELDS),
    _body(text=_field(TEXT, st.lists(TEXT, max_size=3)), input_ids=_field(IDS, st.lists(IDS, max_size=3)),
          **GENERATE_FIELDS),  # both, or neither
)
MESSAGE = _mostly(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
                  st.fixed_dictionaries({"role": st.sampled_from(["assistant", "tool", "x"])},
                                        optional={"content": _field(TEXT, ANY_JSON)}))
CHAT = _body(
    {"messages": _mostly(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(MESSAGE, max_size=3))},
    model=st.sampled_from(["default", "other"]), max_tokens=_field(st.integers(1, 4), EDGE_INTS),
    max_completion_tokens=_field(st.integers(1, 4), EDGE_INTS),
    temperature=_field(st.floats(0, 2), EDGE_FLOAT), top_p=_field(st.floats(0.05, 1), EDGE_FLOAT),
    top_k=_field(st.integers(1, 50), EDGE_INTS), n=_field(st.integers(1, 3), SAMPLES),
    stream=st.booleans(), logprobs=st.booleans(), top_logprobs=_field(st.integers(0, 20), EDGE_INTS),
    stop=_field(st.lists(st.text(min_size=1, max_size=5), max_size=3), st.text(max_size=3)),
    seed=_field(st.integers(0, 2**31), EDGE_INTS),
    logit_bias=_field(st.dictionaries(st.integers(0, VOCAB - 1).map(str), FLOAT, max_size=3),
                      st.dictionaries(EDGE_INTS.map(str), EDGE_FLOAT, max_size=3)),
    frequency_penalty=_field(st.floats(-2, 2), EDGE_FLOAT), presence_penalty=_field(st.floats(-2, 2), EDGE_FLOAT),
    ignore_eos=st.booleans(),
    response_format=st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "nope"}]),
    stream_options=st.sampled_from([{"include_usage": True}, {}]),
)
ENDPOINTS = st.one_of(st.tuples(st.just("/generate"), GENERATE),
                      st.tuples(st.just("/v1/chat/completions"), CHAT))
# Bounded generation: a valid body still costs at most a few decode steps on this CPU.
LIMITS = {"/generate": ("sampling_params", "max_new_tokens"), "/v1/chat/completions": (None, "max_tokens")}


def bounded(path: str, body: dict) -> dict:
    """`body` with its generation length capped at 4 tokens (negative values stay: they are
    hostile, not slow)."""
    outer, key = LIMITS[path]
    if outer and outer not in body:
        body[outer] = {}
    holders = body[outer] if outer else body
    for holder in holders if isinstance(holders, list) else [holders]:
        if isinstance(holder, dict):
            value = holder.get(key)
            holder[key] = min(value, 4) if isinstance(value, int) and not isinstance(value, bool) else 4
    return body


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health_generate", timeout=120) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def fuzz_server(ragged_server):
    yield ragged_server
    assert_serving(ragged_server.base_url)  # after every body: health and a normal chat


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=ENDPOINTS)
def test_fuzzed_bodies_never_break_the_server(fuzz_server, case):
    path, body = case
    body = bounded(path, body)
    # The timeout is for a shared, overloaded 2-core machine; a hang is still caught.
    status, text = send(fuzz_server.base_url, path, json.dumps(body).encode(), timeout=600)
    assert status < 500 or _healthy(fuzz_server.base_url), f"{status} {text[:300]}"
    if status >= 500:  # a 5xx is tolerated only if the server stays healthy; report it anyway
        print(f"5xx for {path} {body}: {text[:200]}")
