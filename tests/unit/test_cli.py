"""`sgl-ragged profile show|plot` and the shipped profiles of the default model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sgl_ragged.cli import main
from sgl_ragged.profile import BudgetProfile, ModelShape

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_DIR = ROOT / "calib_profiles" / "smollm2-135m-instruct"
SHIPPED = sorted(SHIPPED_DIR.glob("*.json"))
SMOLLM2 = ModelShape("LlamaForCausalLM", num_layers=30, num_kv_heads=3, head_dim=64)
DEFAULT = SHIPPED_DIR / "snapkv-rho0.3.json"


def test_the_default_profile_is_shipped() -> None:
    assert DEFAULT.is_file(), "scripts/serve.sh serves this profile by default"
    names = {p.name for p in SHIPPED}
    assert {f"snapkv-rho{r}.json" for r in ("0.7", "0.5", "0.3")} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_profiles_fit_the_default_model(path: Path) -> None:
    profile = BudgetProfile.load(path)
    profile.check_model(SMOLLM2)
    rho = profile.source["rho"]
    if profile.tiers is not None:  # `sgl-ragged profile tiers`: compositions searched for a precision
        search = profile.stats["tier_search"]
        rotated = "r" if profile.tiers.rotated else ""  # searched for rotated rows: mixedr-...
        assert path.name == f"{profile.tiers.precision}{rotated}-{profile.source['kind']}-rho{rho:g}.json"
        assert profile.tiers.rotation == search.get("rotation", "none")
        assert search["chosen"] == min(search["candidates"], key=lambda c: c["kl"])["name"]
        return
    if profile.source["kind"] == "baklava":  # reallocates uniform rho: no samples of retention
        assert path.name == f"baklava-{profile.source['scorer']}-rho{rho:g}.json"
        assert profile.mean_budget <= rho + 1e-6 and profile.stats["baklava"]["search"]
        assert profile.source["samples"] == 16 and profile.source["eval_samples"] == 2
        return
    method = profile.source.get("method", "tangram")
    prefix = "" if method == "tangram" else f"{method}-"
    mean_mode = profile.source.get("budget_mode") == "mean"
    assert path.name == f"{prefix}{profile.source['scorer']}-{'mean-' * mean_mode}rho{rho:g}.json"
    assert profile.source["samples"] == 50
    mean_mu = sum(map(sum, profile.mu)) / 90
    assert math.isclose(mean_mu, rho, abs_tol=0.01)  # Eq. 3 keeps ceil(rho * H * n) per chunk
    if method == "kvcompose":  # one budget per layer, all heads in one group
        assert all(len(set(row)) == 1 for row in profile.budgets) and profile.heads_per_group == 3
    if mean_mode:  # derived from the margin profile's samples
        assert math.isclose(profile.mean_budget, rho, abs_tol=1e-5)
        assert profile.stats["derived_from"] == path.name.replace("mean-", "")
    else:
        assert profile.source["alpha"] == 2.0 and profile.mean_budget > mean_mu
    samples = profile.sample_retention
    assert samples is not None and len(samples.tasks) == 50


def test_show_calibrated_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "show", str(DEFAULT)]) == 0
    out = capsys.readouterr().out
    for text in ("LlamaForCausalLM with 30 layers, 3 KV heads", "calibrated with snapkv",
                 "rho 0.3", "capacity gain x", "rank stability", "coverage", "H_p=1:"):  # fmt: skip
        assert text in out
    assert len([line for line in out.splitlines() if line[:5].strip().isdigit()]) == 30


def test_derive_rebuilds_a_profile_from_its_samples(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    same, mean = tmp_path / "same.json", tmp_path / "mean.json"
    assert main(["profile", "derive", str(DEFAULT), "-o", str(same)]) == 0
    original, rebuilt = BudgetProfile.load(DEFAULT), BudgetProfile.load(same)
    assert rebuilt.groups == original.groups  # the samples are stored to 4 decimals
    assert max(abs(a - b) for ra, rb in zip(original.budgets, rebuilt.budgets, strict=True)
               for a, b in zip(ra, rb, strict=True)) < 1e-3
    assert main(["profile", "derive", str(DEFAULT), "-o", str(mean), "--budget-mode", "mean",
                 "--heads-per-group", "3"]) == 0
    derived = BudgetProfile.load(mean)
    assert math.isclose(derived.mean_budget, 0.3, abs_tol=1e-5) and derived.heads_per_group == 3
    assert "mean B 0.3000" in capsys.readouterr().out
    assert main(["profile", "show", str(mean)]) == 0
    assert "budget mode mean" in capsys.readouterr().out


def test_derive_needs_a_calibrated_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sgl_ragged.profile import uniform_profile

    uniform = tmp_path / "uniform.json"
    uniform_profile(0.3, 30, 3).save(uniform)
    assert main(["profile", "derive", str(uniform), "-o", str(tmp_path / "x.json")]) == 2
    assert "not a calibrated profile with its samples" in capsys.readouterr().err
    assert main(["profile", "derive", str(DEFAULT), "-o", str(tmp_path / "x.json"),
                 "--heads-per-group", "2"]) == 2
    assert "heads" in capsys.readouterr().err


def test_show_uniform_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "show", "uniform:0.3"]) == 0
    out = capsys.readouterr().out
    assert "kind uniform, rho 0.3" in out and "mean B 0.300" in out and "x3.20" in out


def test_show_dynamic_spec(capsys: pytest.CaptureFixture[str]) -> None:
    """The dynamic reference keeps full pages: no memory saved, whatever rho."""
    assert main(["profile", "show", "dynamic:0.3"]) == 0
    out = capsys.readouterr().out
    assert "kind dynamic, rho 0.3" in out and "mean B 1.000" in out and "x1.00" in out
    assert main(["profile", "show", "dynamic:1.5"]) == 2
    assert "dynamic:<rho>" in capsys.readouterr().err


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fig.png"
    assert main(["profile", "plot", str(DEFAULT), "-o", str(out), "--layers", "0", "29"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_rejects_missing_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "plot", str(DEFAULT), "-o", str(tmp_path / "x.png"), "--layers", "30"]) == 2
    assert "layers [30] do not exist; the profile has 30" in capsys.readouterr().err


def _corrupt(tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    data = json.loads(DEFAULT.read_text())
    edit(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["budgets"][3].pop(), r"budgets\[3\] has 2 entries, expected 3"),
        (lambda d: d["stats"]["samples"]["retention"][7].pop(), r"stats.samples.retention\[7\] has 29 layers"),
        (lambda d: d["stats"]["samples"]["retention"][0][0].__setitem__(1, 1.5), "retention outside"),
        (lambda d: d["stats"]["samples"]["tasks"].pop(), "tasks must be 50 strings"),
        (lambda d: d["stats"]["samples"].pop("tokens"), "exactly the keys"),
        (lambda d: d["mu"][0].__setitem__(0, -0.1), r"mu\[0\]\[0\] = -0.1 is outside"),
        (lambda d: d["model"].update(num_kv_heads=4), "the profile's model has 30 layers and 4 KV heads"),
    ],
)  # fmt: skip
def test_corrupted_profiles_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        edit, message: str) -> None:  # type: ignore[no-untyped-def]
    path = _corrupt(tmp_path, edit)
    assert main(["profile", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sgl-ragged: error: profile file") and str(path) in err
    assert re.search(message, err)


def test_profile_for_another_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)  # fmt: skip
    assert main(["profile", "show", str(DEFAULT), "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not fit the model" in err and "num_layers: profile has 30, model has 2" in err
    assert "num_kv_heads: profile has 3, model has 2" in err


def test_missing_profile_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "show", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
