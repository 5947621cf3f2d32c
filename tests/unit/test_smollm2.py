"""The materialized SmolLM2 checkpoint carries sampling defaults, also when it was built before
they existed (no rebuild: the file is added in place)."""

from __future__ import annotations

import json
from pathlib import Path

from sgl_ragged.models import smollm2


def _materialized(cache: Path, generation_config: dict | None) -> Path:
    """A fake, complete checkpoint directory as an older version left it."""
    target = cache / "models" / smollm2.MODEL_NAME
    target.mkdir(parents=True)
    (target / smollm2.MARKER).write_text("ok\n")
    if generation_config is not None:
        (target / "generation_config.json").write_text(json.dumps(generation_config))
    return target


def test_old_checkpoint_gets_the_sampling_defaults(tmp_path: Path):
    target = _materialized(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})
    assert smollm2.ensure_smollm2(tmp_path) == target
    cfg = json.loads((target / "generation_config.json").read_text())
    assert cfg == {"bos_token_id": 1, "eos_token_id": 2, **smollm2.SAMPLING_DEFAULTS}


def test_checkpoint_without_generation_config(tmp_path: Path):
    target = _materialized(tmp_path, None)
    smollm2.ensure_smollm2(tmp_path)
    assert smollm2.has_sampling_defaults(target)


def test_values_set_by_hand_are_kept(tmp_path: Path):
    mine = {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "min_p": 0.05}
    target = _materialized(tmp_path, mine)
    smollm2.ensure_smollm2(tmp_path)
    assert json.loads((target / "generation_config.json").read_text()) == mine


def test_partial_hand_edit_is_completed_not_overwritten(tmp_path: Path):
    target = _materialized(tmp_path, {"temperature": 0.5})
    smollm2.ensure_smollm2(tmp_path)
    cfg = json.loads((target / "generation_config.json").read_text())
    assert cfg == {"temperature": 0.5, "do_sample": True, "top_p": 0.9, "min_p": 0.5}


def test_serve_script_and_readme_serve_the_default():
    """scripts/serve.sh, the README's launch command and the tests' default server agree on
    the default profile and precision (sgl_ragged.models.smollm2)."""
    from sgl_ragged.config import RaggedConfig
    from sgl_ragged.profile import BudgetProfile

    root = Path(__file__).parents[2]
    serve = (root / "scripts/serve.sh").read_text()
    assert f'DEFAULT_PROFILE="$RAGGED_ROOT/{smollm2.DEFAULT_PROFILE}"' in serve
    # the profile's own precision (and rotation): the default's, and any RAGGED_PROFILE's
    assert '--ragged-precision "${RAGGED_PRECISION:-auto}"' in serve
    assert "--ragged-rotation" not in serve
    default = RaggedConfig(profile=str(root / smollm2.DEFAULT_PROFILE))
    assert (default.precision, default.rotation) == (smollm2.DEFAULT_PRECISION, smollm2.DEFAULT_ROTATION)
    assert RaggedConfig(profile="uniform:0.5").precision == "bf16"  # README: another budget
    # OpenMP workers spin before they sleep in the served default, unless the caller says
    # otherwise (the README says how)
    assert 'export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-3000}"' in serve
    readme = (root / "README.md").read_text()
    assert f"--ragged-profile {smollm2.DEFAULT_PROFILE}" in readme
    assert f"--ragged-precision {smollm2.DEFAULT_PRECISION}" in readme
    assert f'"content":"{smollm2.README_QUESTION}"' in readme
    assert "GOMP_SPINCOUNT=3000" in readme and "GOMP_SPINCOUNT=0" in readme  # what its tests and bench.soak ask
    profile = BudgetProfile.load(root / smollm2.DEFAULT_PROFILE)
    assert profile.tiers is not None and profile.tiers.precision == smollm2.DEFAULT_PRECISION
    assert (root / smollm2.DROP_ONLY_PROFILE).is_file()
