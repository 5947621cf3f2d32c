"""bench.offline_loss end to end on a tiny random-weight model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import offline_loss
from sgl_ragged.calibrate.pipeline import CalibrationConfig, calibrate
from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.emulator.compressed import CompressedLoss, FlatTopSelection, token_kl
from sgl_ragged.emulator.runner import CaptureRunner
from sgl_ragged.emulator.samples import build_samples
from sgl_ragged.scoring import make_scorer

TINY = ChunkingConfig(page_size=16, chunk_size=32, obs_window=8)


def test_offline_loss_bench(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_llama
    profiles = tmp_path / "profiles"
    calibrate(CalibrationConfig(
        model_path=str(model), output=str(profiles / "snapkv-rho{rho}.json"), rhos=(0.5,),
        samples=2, chunking=TINY, min_tokens=128, max_tokens=128,
    ), progress=False)  # fmt: skip
    out = tmp_path / "out"
    offline_loss.main([
        "--model", str(model), "--rho", "0.5", "--profile-dir", str(profiles), "--samples", "2",
        "--min-tokens", "128", "--max-tokens", "160", "--page-size", "16", "--chunk-size", "32",
        "--obs-window", "8", "--out", str(out),
    ])  # fmt: skip
    result = json.loads((out / "offline_loss.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert list(rows) == ["full", "uniform@0.5", "static-snapkv@0.5", "dynamic-snapkv@0.5"]
    assert rows["full"]["kl"]["mean"] == 0.0 and rows["full"]["memory"] == 1.0
    assert rows["uniform@0.5"]["memory"] == pytest.approx(0.5)
    assert all(rows[n]["kl"]["mean"] > 0 for n in rows if n != "full")
    pairs = {(d["a"], d["b"]) for d in result["comparisons"]}
    assert pairs == {("static-snapkv@0.5", "uniform@0.5"), ("dynamic-snapkv@0.5", "uniform@0.5")}
    # The dynamic row is the compressed forward's KL, recomputed here sample by sample.
    runner = CaptureRunner(str(model))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    kls, top1, agree = [], [], []
    for sample in build_samples(runner.tokenizer, 2, offline_loss.SEED, 128, 160, 16):
        full = loss.log_probs(sample.input_ids, None)
        logp = loss.log_probs(sample.input_ids, FlatTopSelection(0.5))
        kls.append(float(token_kl(full, logp).mean()))
        targets = sample.input_ids[TINY.chunk_size + 1 :]
        top1.append(sum(int(logp[i].argmax()) == int(t) for i, t in enumerate(targets)) / len(targets))
        agree.append(sum(int(logp[i].argmax()) == int(full[i].argmax()) for i in range(len(targets))) / len(targets))
    assert result["per_sample"]["dynamic-snapkv@0.5"]["kl"] == pytest.approx(kls, rel=1e-6)
    assert result["per_sample"]["dynamic-snapkv@0.5"]["top1"] == pytest.approx(top1)
    assert result["per_sample"]["dynamic-snapkv@0.5"]["agree"] == pytest.approx(agree)
    assert result["per_sample"]["full"]["agree"] == [1.0, 1.0]
    assert (out / "offline_loss.md").read_text().startswith("2 held-out samples")
    assert (out / "kl_vs_memory.png").stat().st_size > 0
    assert "| uniform@0.5 | 0.5 | 0.500 |" in capsys.readouterr().out
    assert torch.isfinite(torch.tensor(result["per_sample"]["static-snapkv@0.5"]["nll"])).all()


def test_offline_loss_bench_precision_rows(tiny_llama: Path, tmp_path: Path) -> None:
    model = tiny_llama
    out = tmp_path / "out"
    offline_loss.main([
        "--model", str(model), "--rho", "0.5", "--profile-dir", str(tmp_path), "--samples", "1",
        "--min-tokens", "128", "--max-tokens", "128", "--page-size", "16", "--chunk-size", "32",
        "--obs-window", "8", "--precision", "int4", "--stock-fp8", "--stock", "fp4_mx_block16",
        "nvfp4", "--only", "int4@0.5", "int4-all@0.375", "sglang-fp8", "sglang-fp4_mx_block16",
        "sglang-nvfp4", "--out", str(out),
    ])  # fmt: skip
    # int4-all is sized for this model (head_dim 16) and page (16): a page of int4 costs 384 of
    # a bf16 page's 1024 bytes, 6 of 16 slots.
    result = json.loads((out / "offline_loss.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert list(rows) == ["full", "int4-all@0.375", "int4@0.5", "sglang-fp4_mx_block16",
                          "sglang-nvfp4", "sglang-fp8"]  # fmt: skip
    assert rows["int4-all@0.375"]["memory"] == pytest.approx(0.375)
    assert rows["sglang-fp8"]["memory"] == 0.5 and rows["int4@0.5"]["memory"] <= 0.5
    assert rows["sglang-fp4_mx_block16"]["memory"] == rows["sglang-nvfp4"]["memory"] == 0.28125
    assert all(rows[n]["kl"]["mean"] > 0 for n in rows if n != "full")
    # each configuration against every SGLang cache that costs at least its bytes (the FP4
    # caches' 0.281 is less than int4-all's 0.375 at head_dim 16)
    pairs = {(d["a"], d["b"]) for d in result["comparisons"]}
    assert pairs == {("int4-all@0.375", "sglang-fp8"), ("int4@0.5", "sglang-fp8")}



def test_offline_loss_bench_rotated_rows(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    offline_loss.main([
        "--model", str(tiny_llama), "--rho", "0.5", "--profile-dir", str(tmp_path), "--samples", "1",
        "--min-tokens", "128", "--max-tokens", "128", "--page-size", "16", "--chunk-size", "32",
        "--obs-window", "8", "--precision", "int4", "int4r", "int8+int4r", "--only", "int4@0.5",
        "int4r@0.5", "int4-all@0.375", "int4r-all@0.375", "int8+int4r@0.5", "--out", str(out),
    ])  # fmt: skip
    result = json.loads((out / "offline_loss.json").read_text())
    rows = {r["name"]: r for r in result["configs"]}
    assert rows["int4r@0.5"]["memory"] == rows["int4@0.5"]["memory"]
    assert rows["int4r-all@0.375"]["memory"] == rows["int4-all@0.375"]["memory"] == pytest.approx(0.375)
    assert rows["int4r@0.5"]["kl"]["mean"] != rows["int4@0.5"]["kl"]["mean"]
    assert all(rows[n]["kl"]["mean"] > 0 for n in rows if n != "full")
    pairs = {(d["a"], d["b"]) for d in result["comparisons"]}
    assert {("int4r@0.5", "int4@0.5"), ("int4r-all@0.375", "int4-all@0.375")} <= pairs
    assert rows["int8+int4r@0.5"]["memory"] <= 0.5
    assert "top-1 agreement with full" in (out / "offline_loss.md").read_text()


def test_offline_loss_bench_profile_config(tiny_llama: Path, tmp_path: Path) -> None:
    """--profile-config NAME=PATH[=PRECISION]: a profile file as one configuration. A uniform
    file served at int8+int4 is the bench's own int8+int4@0.5 (same composition, same bytes,
    same KL); without =PRECISION a file without compositions is drop-only (bf16)."""
    from sgl_ragged.profile import model_shape, uniform_profile

    shape = model_shape(str(tiny_llama))
    path = tmp_path / "half.json"
    uniform_profile(0.5, shape.num_layers, shape.num_kv_heads).save(path)
    out = tmp_path / "out"
    offline_loss.main([
        "--model", str(tiny_llama), "--rho", "0.5", "--profile-dir", str(tmp_path), "--samples", "1",
        "--min-tokens", "128", "--max-tokens", "128", "--page-size", "16", "--chunk-size", "32",
        "--obs-window", "8", "--precision", "int8+int4", "--profile-config", f"mine={path}=int8+int4",
        f"drop={path}", "--only", "int8+int4@0.5", "uniform@0.5", "mine", "drop", "--out", str(out),
    ])  # fmt: skip
    rows = {r["name"]: r for r in json.loads((out / "offline_loss.json").read_text())["configs"]}
    assert rows["mine"]["memory"] == pytest.approx(rows["int8+int4@0.5"]["memory"])
    assert rows["mine"]["kl"]["mean"] == pytest.approx(rows["int8+int4@0.5"]["kl"]["mean"], rel=1e-6)
    assert rows["drop"]["kl"]["mean"] == pytest.approx(rows["uniform@0.5"]["kl"]["mean"], rel=1e-6)
    assert rows["mine"]["kl"]["mean"] < rows["drop"]["kl"]["mean"]
    with pytest.raises(ValueError, match="expected NAME=PATH or NAME=PATH=PRECISION"):
        offline_loss.main(["--model", str(tiny_llama), "--profile-config", str(path)])


def test_selection_of_a_per_head_profile_quantizes_each_head_in_its_format(tmp_path: Path) -> None:
    """A per-head precision profile (--precision mixed or --profile-config) is emulated with
    each head's low tier in its own format, as the server stores it (not all in the commonest
    one), rotated for mixedr."""
    from bench.accuracy_configs import PROFILE, Config
    from sgl_ragged.profile import ModelShape
    from tests.unit.test_per_head_precision import mixed_profile

    profile = mixed_profile(layers=2, heads=4)
    path = tmp_path / "mixed.json"
    profile.save(path)
    shape = ModelShape("LlamaForCausalLM", 2, 4, 16)
    want = [[name if lo > 0 else None for name, lo in zip(names, los, strict=True)]
            for names, los in zip(profile.tiers.formats, profile.tiers.lo, strict=True)]
    assert len({f for layer in want for f in layer if f}) > 1
    for precision in ("mixed", "mixedr"):
        config = Config("m", PROFILE, 0.5, "snapkv", str(path), precision)
        selection, _ = offline_loss.selection_for(config, shape, 8)
        assert [[f and f.name for f in layer] for layer in selection.formats] == want
        assert (selection.rotation is not None) == (precision == "mixedr")
