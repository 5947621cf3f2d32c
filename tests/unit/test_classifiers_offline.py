"""The offline tools on sequence classifiers (config.SEQUENCE_CLASSIFIERS): captured like their
causal families, calibrated by retention (TANGRAM), refused by the next-token-loss tools with
what to run instead. Served: tests/e2e/test_classifiers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgl_ragged.calibrate.pipeline import CalibrationConfig, calibrate
from sgl_ragged.config import SEQUENCE_CLASSIFIERS
from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.emulator.compressed import CompressedLoss
from sgl_ragged.emulator.runner import CaptureRunner
from sgl_ragged.profile import ModelShape, model_shape, resolve_profile
from sgl_ragged.scoring import make_scorer
from sgl_ragged.testing.tiny_model import save_tiny_model


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {arch: save_tiny_model(root / arch, arch) for arch in SEQUENCE_CLASSIFIERS}


@pytest.mark.parametrize("arch", SEQUENCE_CLASSIFIERS)
def test_a_classifier_is_captured_and_calibrated(classifiers, arch: str, tmp_path: Path) -> None:
    model = classifiers[arch]
    assert model_shape(str(model)) == ModelShape(arch, 2, 2, 16)
    runner = CaptureRunner(str(model))
    assert runner.classifier and runner.scale == pytest.approx(16 ** -0.5)
    layers = runner.run(torch.arange(40) % 256)
    assert [tuple(x.shape) for x in (layers[0].q, layers[0].k)] == [(40, 4, 16), (40, 2, 16)]
    for source in ("tangram", "kvcompose"):  # retention, no next-token loss
        cfg = CalibrationConfig(model_path=str(model), output=str(tmp_path / f"{source}.json"),
                                samples=2, source=source, heads_per_group=1,
                                chunking=ChunkingConfig(16, 64, 8), min_tokens=96, max_tokens=128)
        (path,) = calibrate(cfg, progress=False)
        profile = resolve_profile(str(path), model_shape(str(model)))
        assert all(0.0 < b <= 1.0 for row in profile.budgets for b in row), source


def test_next_token_losses_are_refused_for_a_classifier(classifiers, tmp_path, capsys) -> None:
    from sgl_ragged.calibrate.cli import main

    model = str(classifiers["LlamaForSequenceClassification"])
    assert main([model, "--source", "baklava", "--samples", "1", "--quiet",
                 "--output", str(tmp_path / "b.json")]) == 2
    assert "is a sequence classifier" in capsys.readouterr().err
    runner = CaptureRunner(model)
    for call in (lambda: runner.logits(torch.arange(8)),
                 lambda: CompressedLoss(runner, make_scorer("snapkv"), ChunkingConfig(16, 64, 8))):
        with pytest.raises(ValueError, match="is a sequence classifier: it has no language-model "
                                             "head.*--source tangram or kvcompose"):
            call()
