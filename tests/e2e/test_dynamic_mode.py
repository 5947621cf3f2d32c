"""The dynamic reference mode (`--ragged-profile dynamic:<rho>`) served end to end: pages stay
full-size, each sealing keeps TANGRAM Eq. 3's global top-ceil(rho * H * N) entries of a layer."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import COMMON, _start, get, post
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

RHO = 0.3


@pytest.fixture(scope="module")
def dynamic_server(request: pytest.FixtureRequest, model_path: str):
    return _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                            "--ragged-profile", f"dynamic:{RHO}", "--max-total-tokens", "4096",
                            "--max-running-requests", "4", "--enable-metrics"], "dynamic")


def _counter(metrics: str, name: str) -> float:
    match = re.search(rf"^sglang:{name}_total(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_dynamic_mode_keeps_rho_and_answers(dynamic_server):
    log = dynamic_server.log_text()
    assert "retention 1.000" in log  # full-size pages: the reference saves no memory
    out = post(dynamic_server.base_url, "/generate", {
        "text": FACTS + "\nQuestion: what is the code of item 3? Answer:",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    })
    assert out["meta_info"]["completion_tokens"] > 0
    metrics = get(dynamic_server.base_url, "/metrics")
    kept, seen = _counter(metrics, "ragged_entries_kept"), _counter(metrics, "ragged_entries_seen")
    assert seen > 0
    # Each sealing keeps ceil(rho * H * N) entries (sinks included), so the share is rho, rounded up.
    assert RHO <= kept / seen < RHO + 0.02
