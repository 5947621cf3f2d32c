"""Shipped calibrated profiles served end to end: the server reserves exactly the page cost the
profile predicts, serves requests and compresses with it. The README's default (TANGRAM, H_p 1)
and the other budget sources: BaKlaVa (kind "baklava", some heads at B = 1) and KVCompose (one
group of all heads per layer)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import BudgetProfile
from tests.e2e.conftest import COMMON, _start, get, post
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

PROFILES = Path(__file__).parents[2] / "calib_profiles/smollm2-135m-instruct"
MAX_TOKENS = 16384  # an explicit pool cap: the memory profiling of a busy machine varies
NAMES = ["snapkv-rho0.3", "baklava-snapkv-rho0.5", "kvcompose-snapkv-mean-rho0.3"]


@pytest.fixture(scope="module", params=NAMES)
def calibrated_server(request: pytest.FixtureRequest, model_path: str):
    profile = PROFILES / f"{request.param}.json"
    server = _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                              "--ragged-profile", str(profile), "--max-total-tokens", str(MAX_TOKENS),
                              "--max-running-requests", "4", "--enable-metrics"],
                    f"calibrated-{request.param}")
    server.profile = profile
    return server


def test_capacity_is_what_the_profile_predicts(calibrated_server, model_path):
    cfg = AutoConfig.from_pretrained(model_path)
    layout = RaggedLayout.from_profile(BudgetProfile.load(calibrated_server.profile), 64, 64, 2)  # bf16
    assert layout.num_kv_heads == cfg.num_key_value_heads
    log = calibrated_server.log_text()
    cells = re.findall(r"ragged capacity: (\d+) bytes per logical token", log)
    assert len(cells) == 1  # said once, though SGLang sizes the pool with two configurators
    cell = int(cells[0])
    assert cell == -(-layout.row_bytes_per_page // 64)
    pages = int(re.search(r"ragged capacity: (\d+) logical pages", log).group(1))
    info = json.loads(get(calibrated_server.base_url, "/get_server_info"))
    assert info["max_total_num_tokens"] == min(pages * 64, MAX_TOKENS)
    assert f"retention {layout.retention:.3f}" in log


def test_serves_and_compresses_with_the_profile(calibrated_server):
    out = post(calibrated_server.base_url, "/generate", {
        "text": FACTS + "\nQuestion: what is the code of item 3? Answer:",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    })
    assert out["meta_info"]["completion_tokens"] > 0
    metrics = get(calibrated_server.base_url, "/metrics").replace(":", "_")
    sealed = re.search(r"^sglang_ragged_pages_sealed_total(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    assert sealed and float(sealed.group(1)) > 0
