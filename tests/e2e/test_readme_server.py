"""A server as README.md and scripts/serve.sh start it (the default profile and precision:
per-head precision at 0.3 of the bytes; the model's own sampling defaults), exposed with --api-key: the README's question, asked without a
temperature, is answered, and requests without the key are refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE, README_QUESTION
from sgl_ragged.testing.server import ServerProcess
from tests.e2e.conftest import COMMON, _start

pytestmark = pytest.mark.e2e

KEY = "test-key-1c9e"
PROFILE = Path(__file__).parents[2] / DEFAULT_PROFILE
README_CHAT = {"model": "default", "max_tokens": 30,
               "messages": [{"role": "user", "content": README_QUESTION}]}


@pytest.fixture(scope="module")
def readme_server(request: pytest.FixtureRequest, model_path: str) -> ServerProcess:
    return _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                            "--ragged-profile", str(PROFILE), "--ragged-precision", DEFAULT_PRECISION,
                            "--max-total-tokens", "4096",
                            "--max-running-requests", "4", "--api-key", KEY], "readme")


def _chat(base_url: str, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base_url + "/v1/chat/completions", headers=headers,
                                 data=json.dumps(README_CHAT).encode())
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no-key", "wrong-key"])
def test_api_key_refuses_other_requests(readme_server, key):
    assert _chat(readme_server.base_url, key)[0] == 401


def test_api_key_admits_its_holder(readme_server):
    status, out = _chat(readme_server.base_url, KEY)
    assert status == 200 and out["choices"][0]["message"]["content"]


def test_readme_question_without_temperature(readme_server):
    """The checkpoint's generation_config.json (temperature 0.1, top_p 0.9, min_p 0.5) is the
    chat default."""
    assert ("Using default chat sampling params from model generation config: "
            "{'temperature': 0.1, 'top_p': 0.9, 'min_p': 0.5}") in readme_server.log_text()
    answers = [_chat(readme_server.base_url, KEY)[1]["choices"][0]["message"]["content"]
               for _ in range(5)]
    assert sum("Paris" in a for a in answers) >= 4, answers


def test_no_environment_warnings(readme_server):
    """Our scripts export RAGGED_* variables only: SGLang rewrites every SGL_* variable of its
    environment and warns about each ("... is deprecated, please use SGLANG_...")."""
    assert "is deprecated, please use SGLANG_" not in readme_server.log_text()
