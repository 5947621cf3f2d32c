"""The offline model runs (calibration, bench.offline_loss) on every supported architecture.

`CaptureRunner` routes each layer's attention through a transformers attention function of its
own: it must capture every layer's post-RoPE Q/K/V, and with the compressed loss's attention at
a full budget give the model's own loss (its own head included: Granite divides its logits by
`logits_scaling`, Gemma ties them to the embeddings), whatever the architecture's MLP (the MoE
ones route tokens to experts) or norms.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sgl_ragged.config import SUPPORTED_ARCHITECTURES
from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.emulator.compressed import CompressedLoss, SlotSelection
from sgl_ragged.emulator.runner import CaptureRunner
from sgl_ragged.emulator.samples import build_samples
from sgl_ragged.profile import ModelShape, model_shape
from sgl_ragged.scoring import make_scorer
from sgl_ragged.testing.tiny_model import MHA_ONLY, save_tiny_model

TINY = ChunkingConfig(page_size=16, chunk_size=32, obs_window=8)


def _kv_heads(arch: str) -> int:
    return 4 if arch in MHA_ONLY else 2  # the checkpoints' 4 query heads


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("offline-arch")
    return {arch: save_tiny_model(root / arch, arch, layers=2, kv_heads=2, q_heads=4)
            for arch in SUPPORTED_ARCHITECTURES}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_fingerprint_names_the_checkpoints_architecture(checkpoints, arch: str) -> None:
    # a vision-language model's geometry is its language model's (text_config), its
    # architecture the checkpoint's own
    assert model_shape(str(checkpoints[arch])) == ModelShape(arch, 2, _kv_heads(arch), 16)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_runner_captures_every_layer(checkpoints, arch: str) -> None:
    runner = CaptureRunner(str(checkpoints[arch]))
    layers = runner.run(torch.arange(40) % 256)
    assert len(layers) == runner.shape.num_layers == 2
    kv = _kv_heads(arch)
    for layer in layers:
        assert (layer.q.shape, layer.k.shape, layer.v.shape) == ((40, 4, 16), (40, kv, 16), (40, kv, 16))
    for li in range(2):  # per-head precision's search projects each head's error through it
        assert runner.output_projection(li).shape == (64, 4 * 16)
    # Granite's attention_multiplier; OPT scales its queries before attention and passes 1.0
    want = {"GraniteForCausalLM": 0.3, "GraniteMoeForCausalLM": 0.3,
            "OPTForCausalLM": 1.0}.get(arch, 16 ** -0.5)
    assert runner.scale == pytest.approx(want)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_a_full_budget_gives_the_models_own_loss(checkpoints, arch: str) -> None:
    runner = CaptureRunner(str(checkpoints[arch]))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    (sample,) = build_samples(runner.tokenizer, 1, 0, 96, 96, 16)
    full = loss.token_nll(sample.input_ids, None)
    assert full.shape == (96 - 32 - 1,)
    with torch.no_grad():
        logits = runner.model(input_ids=sample.input_ids[None]).logits[0].float()
    want = torch.nn.functional.cross_entropy(logits[32:-1].double(), sample.input_ids[33:],
                                             reduction="none")
    assert torch.allclose(full, want, atol=1e-5)
    kv = _kv_heads(arch)
    kept = loss.token_nll(sample.input_ids, SlotSelection([[16] * kv] * 2))
    assert torch.allclose(kept, full, atol=1e-5)
    squeezed = loss.token_nll(sample.input_ids, SlotSelection([[4] * kv] * 2))
    assert not torch.allclose(squeezed, full, atol=1e-3)
    with pytest.raises(ValueError, match="no token after the first"):
        loss.token_nll(sample.input_ids[:32], None)


@pytest.mark.parametrize("arch", ["PhiForCausalLM", "OPTForCausalLM"])
def test_per_head_precision_searches_on_other_projection_names(checkpoints, arch: str,
                                                               tmp_path: Path) -> None:
    """The per-head precision search weighs each head's error by the attention's output
    projection: Phi's is `dense`, OPT's `out_proj` (Phi's search failed on `o_proj` before)."""
    from sgl_ragged.cli import main

    out = tmp_path / "mixed.json"
    assert main(["profile", "tiers", "uniform:0.3", "--model", str(checkpoints[arch]),
                 "--precision", "mixed", "-o", str(out), "--samples", "2", "--sens-samples", "1",
                 "--page-size", "16", "--chunk-size", "32", "--min-tokens", "128",
                 "--max-tokens", "128"]) == 0
    assert json.loads(out.read_text())["tiers"]["precision"] == "mixed"
