"""emulator/lora.merge_lora against LoRA as a separate branch, its refusals, and a calibration for
an adapter. (Its scaling against SGLang's own adapters: tests/e2e/test_lora.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl_ragged.calibrate.pipeline import CalibrationConfig, calibrate
from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.emulator.lora import merge_lora
from sgl_ragged.emulator.runner import CaptureRunner
from sgl_ragged.profile import model_shape, resolve_profile
from sgl_ragged.testing.tiny_model import save_lora_adapter, save_tiny_llama


def _branch_logits(model_path: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits with the adapter as PEFT's LoRA branch beside each unmerged projection:
    out = W x + (alpha / r) * B (A x), by forward hooks."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    for key in {k.rsplit(".lora_", 1)[0] for k in weights}:
        a, b = weights[f"{key}.lora_A.weight"].float(), weights[f"{key}.lora_B.weight"].float()
        modules[key.removeprefix("base_model.model.")].register_forward_hook(
            lambda _m, inputs, out, a=a, b=b: out + scaling * (inputs[0] @ a.T) @ b.T)
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def test_merged_adapter_is_the_lora_branch(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "llama")
    adapter = save_lora_adapter(model, tmp_path / "a", rank=4, alpha=8, seed=5)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0))
    runner = CaptureRunner(model, lora=adapter)
    merged = runner.logits(ids)
    want = _branch_logits(model, adapter, ids)
    assert (merged - want).abs().max() < 1e-4
    assert (CaptureRunner(model).logits(ids) - want).abs().max() > 1e-2  # the adapter matters


def test_adapters_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_path = save_tiny_llama(tmp_path / "llama")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    wider = save_tiny_llama(tmp_path / "wider", q_heads=8)
    with pytest.raises(ValueError, match=r"o_proj's update is \[64, 128\], its weight \[64, 64\]"):
        merge_lora(model, save_lora_adapter(wider, tmp_path / "wide"))
    deeper = save_tiny_llama(tmp_path / "deeper", layers=3)
    with pytest.raises(ValueError, match="names model.layers.2.self_attn.k_proj, which this "
                                         "model has no weight for"):
        merge_lora(model, save_lora_adapter(deeper, tmp_path / "deep"))
    dora = save_lora_adapter(model_path, tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="a DoRA adapter, which SGLang does not serve"):
        merge_lora(model, dora)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        merge_lora(model, tmp_path)


def test_calibration_for_an_adapter(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "llama")
    adapter = save_lora_adapter(model, tmp_path / "strong", strength=3.0, seed=1)
    profiles = {}
    for name, lora in (("base", None), ("adapter", str(adapter))):
        cfg = CalibrationConfig(
            model_path=str(model), output=str(tmp_path / f"{name}.json"), rhos=(0.3,),
            samples=3, chunking=ChunkingConfig(16, 64, 8), min_tokens=96, max_tokens=160,
            lora=lora)
        (path,) = calibrate(cfg, progress=False)
        profiles[name] = resolve_profile(str(path), model_shape(str(model)))
    assert profiles["adapter"].source["lora_name"] == "strong"
    assert "lora_name" not in profiles["base"].source
    # Same samples, other keys and queries: the adapter's heads retain other shares.
    assert np.abs(np.asarray(profiles["adapter"].mu) - np.asarray(profiles["base"].mu)).max() > 1e-3


def test_the_calibrator_says_what_is_wrong_with_an_adapter(tmp_path: Path, capsys) -> None:
    from sgl_ragged.calibrate.cli import main

    model = save_tiny_llama(tmp_path / "llama")
    code = main([str(model), "--lora", str(tmp_path / "missing"), "--samples", "1",
                 "--output", str(tmp_path / "out.json"), "--quiet"])
    assert code == 2
    assert "error: LoRA adapter" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_tier_searches_of_an_adapters_profile_need_its_adapter(tmp_path: Path, capsys) -> None:
    """`profile tiers` (int4 and the per-head mixed search) on a profile calibrated for an
    adapter: with the adapter it searches and records it, without it (or with another) it
    says what to pass."""
    from sgl_ragged.calibrate.cli import main as calibrate_main
    from sgl_ragged.cli import main

    model = save_tiny_llama(tmp_path / "llama")
    adapter = save_lora_adapter(model, tmp_path / "ad", seed=4)
    other = save_lora_adapter(model, tmp_path / "other", seed=5)
    sizes = ["--page-size", "16", "--chunk-size", "64", "--min-tokens", "128",
             "--max-tokens", "128"]
    profile = tmp_path / "ad.json"
    assert calibrate_main([str(model), "--lora", str(adapter), "--samples", "2", "--rho", "0.5",
                           "--output", str(profile), "--quiet", "--obs-window", "8",
                           *sizes]) == 0
    for precision in ("int4", "mixed"):
        search = ["profile", "tiers", str(profile), "--model", str(model), "--precision",
                  precision, "--samples", "1", "--sens-samples", "1", *sizes]
        for lora in (None, other):
            assert main([*search, "-o", str(tmp_path / "x.json"),
                         *(["--lora", str(lora)] if lora else [])]) == 2
            assert ("calibrated for LoRA adapter 'ad'" in capsys.readouterr().err)
        out = tmp_path / f"{precision}.json"
        assert main([*search, "-o", str(out), "--lora", str(adapter)]) == 0
        data = json.loads(out.read_text())
        assert data["stats"]["tier_search"]["lora_name"] == "ad"
        assert data["source"]["lora_name"] == "ad"
