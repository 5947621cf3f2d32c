"""The request guard against a real server: requests that crash stock SGLang's scheduler get a
400 naming the field, streamed ones before the stream opens, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.e2e.conftest import get, post

pytestmark = pytest.mark.e2e

VOCAB = 49152  # SmolLM2-135M-Instruct
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}


def send(base_url: str, path: str, body: Any, timeout: float = 300) -> tuple[int, str]:
    """Status and body text of a POST (any status; the connection must not break)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def assert_serving(base_url: str) -> None:
    """Health (one generated token) and a normal chat answer."""
    with urllib.request.urlopen(base_url + "/health_generate", timeout=120) as resp:
        assert resp.status == 200
    out = post(base_url, "/v1/chat/completions", {**CHAT, "temperature": 0})
    assert out["choices"][0]["message"]["content"]


GEN = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}
# (path, body, field named in the 400, allowed range named in it). The first three crashed the
# scheduler of stock SGLang 0.5.23 (issue 12).
CASES = [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1000000}, "top_logprobs", "[0, 20]"),
    ("/generate", {"input_ids": [1000000000, 5], **GEN}, "input_ids[0] = 1000000000", f"[0, {VOCAB})"),
    ("/generate", {"text": "", **GEN}, "text", "at least one token"),
    ("/generate", {"input_ids": [], **GEN}, "input_ids", "at least one token"),
    ("/generate", {"input_ids": [5, -3], **GEN}, "input_ids[1] = -3", f"[0, {VOCAB})"),
    ("/generate", {"text": "Hi", "return_logprob": True, "top_logprobs_num": VOCAB + 1, **GEN},
     "top_logprobs_num", f"[0, {VOCAB}]"),
    ("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 9, **GEN},
     "logprob_start_len", "[-1, 2]"),
    ("/generate", {"text": ["ok", ""], **GEN}, "text", "at least one token"),  # batch: per item
    ("/v1/completions", {"model": "default", "prompt": [1000000000], "max_tokens": 4},
     "input_ids[0] = 1000000000", f"[0, {VOCAB})"),
    ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 4, "logprobs": 1000},
     "logprobs", "[0, 5]"),
]


@pytest.mark.parametrize("path,body,field,allowed", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_crashing_request_gets_400(ragged_server, path, body, field, allowed, stream):
    if stream and isinstance(body.get("text"), list):
        pytest.skip("batch requests cannot stream")
    status, text = send(ragged_server.base_url, path, {**body, "stream": stream})
    assert status == 400, text
    assert field in text and allowed in text, text


def test_server_serves_after_the_crash_requests(ragged_server):
    for path, body, _, _ in CASES:
        send(ragged_server.base_url, path, body)
    assert_serving(ragged_server.base_url)


def test_stock_limits_still_apply(ragged_server):
    """Fields SGLang validates itself keep its 400s (the guard adds, it does not replace)."""
    status, text = send(ragged_server.base_url, "/generate",
                        {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "top_p": 0}})
    assert status == 400 and "top_p" in text
    assert "sglang:num_requests_total" in get(ragged_server.base_url, "/metrics")
