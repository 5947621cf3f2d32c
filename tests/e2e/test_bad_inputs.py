"""Bad launch configurations fail at startup with a message that says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_ragged.profile import BudgetProfile, ModelShape
from sgl_ragged.testing.server import ServerError, ServerProcess
from tests.e2e.conftest import COMMON

pytestmark = pytest.mark.e2e


def _launch_error(model: str, extra: list[str]) -> str:
    server = ServerProcess(["--model-path", model, *COMMON, "--attention-backend", "ragged", *extra],
                           startup_timeout=300)
    with pytest.raises(ServerError):
        server.start()
    return server.log_text()


def test_profile_for_another_model(model_path, tmp_path: Path):
    other = ModelShape("LlamaForCausalLM", num_layers=30, num_kv_heads=8, head_dim=64)
    profile = BudgetProfile(model=other, budgets=[[0.5] * 8] * 30, groups=[[tuple(range(8))]] * 30,
                            source={"kind": "calibrated", "scorer": "snapkv"})
    path = tmp_path / "other.json"
    profile.save(path)
    log = _launch_error(model_path, ["--ragged-profile", str(path)])
    assert "budget profile does not fit the model" in log
    assert "num_kv_heads: profile has 8, model has 3" in log


def test_missing_profile_file(model_path, tmp_path: Path):
    log = _launch_error(model_path, ["--ragged-profile", str(tmp_path / "nope.json")])
    assert "nope.json" in log


def test_malformed_profile_file(model_path, tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    log = _launch_error(model_path, ["--ragged-profile", str(path)])
    assert "broken.json" in log and "ProfileError" in log


def test_page_size_must_divide_chunk(model_path):
    log = _launch_error(model_path, ["--ragged-profile", "uniform:0.5", "--chunked-prefill-size", "100"])
    assert "not a multiple of --page-size 64" in log


def test_bad_uniform_spec(model_path):
    log = _launch_error(model_path, ["--ragged-profile", "uniform:1.7"])
    assert "uniform" in log and "1.7" in log


def test_unsupported_architecture(tmp_path: Path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    log = _launch_error(str(tmp_path), ["--ragged-profile", "uniform:0.5"])
    assert "does not support GPT2LMHeadModel" in log and "LlamaForCausalLM" in log


def test_tp_size_not_dividing_the_kv_heads(model_path):
    log = _launch_error(model_path, ["--ragged-profile", "uniform:0.5", "--tp-size", "2"])
    assert "--tp-size 2 does not divide the model's 3 KV heads" in log and "[1, 3]" in log


def test_sliding_window_layers_are_refused_when_the_model_loads(tmp_path: Path):
    """A checkpoint of a supported family whose SGLang model builds sliding-window layers
    (OLMo 2's code reads a config's `layer_types`): the backend would attend over the whole
    history, so it refuses the model once it has loaded, naming the layer, and the launch
    ends."""
    from sgl_ragged.testing.tiny_model import save_tiny_model

    model = save_tiny_model(tmp_path / "olmo2-swa", "Olmo2ForCausalLM")
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    config_path.write_text(json.dumps(config))
    log = _launch_error(str(model), ["--ragged-profile", "uniform:0.5", "--dtype", "float32",
                                     "--max-total-tokens", "2048"])
    assert "cannot serve this checkpoint: its attention layer model.layers.0.self_attn.attn" in log
    assert "asks for a sliding window" in log
