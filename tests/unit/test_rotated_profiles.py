"""Profiles searched for rotated rows (`sgl-ragged profile tiers --rotation hadamard`): the
profile's tiers.rotation (format version 4), what --ragged-rotation auto serves from it and what
the server refuses, the per-head search's sensitivity step on rotated rows against a brute force
(dense matrices), the searches end to end on a tiny random model, and the benches' names for
such a profile."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_ragged.calibrate.precision_search import Option, group_errors
from sgl_ragged.calibrate.tier_search import TierSearchConfig
from sgl_ragged.cli import main
from sgl_ragged.config import RaggedConfig
from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.profile import BudgetProfile, ProfileError, ProfileTiers, profile_tiers
from sgl_ragged.rotation import Rotation, rotation_of
from sgl_ragged.scoring import SnapKVScorer

from .test_per_head_precision import mixed_profile

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "calib_profiles/smollm2-135m-instruct"


def rotated(profile: BudgetProfile, rotation: str = "hadamard") -> BudgetProfile:
    t = profile.tiers
    return BudgetProfile(profile.model, profile.budgets, profile.groups, profile.source,
                         tiers=ProfileTiers(t.precision, t.hi, t.lo, t.formats, rotation))


# ---- the profile ---------------------------------------------------------------------------

def test_a_rotated_profile_round_trips_as_version_4(tmp_path: Path) -> None:
    path = tmp_path / "rotated.json"
    profile = rotated(mixed_profile())
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 4 and data["tiers"]["rotation"] == "hadamard"
    assert BudgetProfile.load(path) == profile and BudgetProfile.load(path).tiers.rotated
    assert profile_tiers(str(path)).rotation == "hadamard"
    # unrotated tiers are written as before: no rotation key, the oldest version that holds them
    plain = tmp_path / "plain.json"
    mixed_profile().save(plain)
    data_plain = json.loads(plain.read_text())
    assert data_plain["version"] == 3 and "rotation" not in data_plain["tiers"]
    assert profile_tiers(str(plain)).rotation == "none"
    assert profile_tiers("uniform:0.3") is None
    assert profile_tiers(str(SHIPPED / "snapkv-rho0.3.json")) is None  # no tiers
    data["version"] = 3  # version 3 knows no rotation: an older reader refuses the file
    with pytest.raises(ProfileError, match="from version 4, rotation"):
        BudgetProfile.from_dict(data)


def test_a_bad_rotation_is_refused_with_the_choices() -> None:
    with pytest.raises(ProfileError, match=r"tiers.rotation 'givens' is not one of \['none', 'hadamard'\]"):
        rotated(mixed_profile(), "givens")


# ---- what the server serves ----------------------------------------------------------------

def test_auto_serves_the_profiles_rotation_and_none_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rotated.json"
    rotated(mixed_profile()).save(path)
    spec = str(path)
    assert RaggedConfig(profile=spec).rotation == "hadamard"  # auto: precision mixed, rotated
    assert RaggedConfig.from_env({"RAGGED_PROFILE": spec}).rotation == "hadamard"
    assert RaggedConfig(profile=spec, rotation="hadamard").rotated
    with pytest.raises(ValueError, match="was searched for rows stored with --ragged-rotation "
                                         "hadamard .* pass --ragged-rotation hadamard"):
        RaggedConfig(profile=spec, rotation="none")
    with pytest.raises(ValueError, match=r"choose one of \['auto', 'none', 'hadamard'\]"):
        RaggedConfig(profile=spec, rotation="givens")
    # unrotated profiles, model-free specs and files without tiers: auto is none
    plain = tmp_path / "plain.json"
    mixed_profile().save(plain)
    for other in (str(plain), "uniform:0.3", str(SHIPPED / "snapkv-rho0.3.json"),
                  str(SHIPPED / "mixed-uniform-rho0.3.json")):
        assert RaggedConfig(profile=other).rotation == "none"
    assert RaggedConfig(profile=str(plain), rotation="hadamard").rotated  # mixedr: allowed


def test_a_rotated_single_precision_profile_at_another_precision_is_not_rotated(tmp_path: Path) -> None:
    """Tiers are read only at their own precision; served at another, the profile's budgets
    take the default rule and auto takes no rotation (an explicit one is still honoured)."""
    t = mixed_profile().tiers
    path = tmp_path / "int4r.json"
    no_formats = ProfileTiers("int4", t.hi, t.lo, None, "hadamard")
    base = mixed_profile()
    BudgetProfile(base.model, base.budgets, base.groups, base.source, tiers=no_formats).save(path)
    assert RaggedConfig(profile=str(path)).precision == "int4"
    assert RaggedConfig(profile=str(path)).rotation == "hadamard"
    assert RaggedConfig(profile=str(path), precision="int8").rotation == "none"
    assert RaggedConfig(profile=str(path), precision="int8", rotation="hadamard").rotated


# ---- the sensitivity step on rotated rows ----------------------------------------------------

def _layer(tokens: int, h_kv: int, rep: int, d: int, seed: int) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, h_kv, d, generator=gen)
    v = torch.randn(tokens, h_kv, d, generator=gen)
    v[..., 5] *= 10  # a value outlier channel (values are quantized per token): what rotating is for
    return SimpleNamespace(q=torch.randn(tokens, h_kv * rep, d, generator=gen), k=k, v=v)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotated_group_errors_are_the_errors_of_rotated_rows(seed: int) -> None:
    """Brute force: rotate the whole layer's q, k, v by each head's dense matrix and the o_proj
    columns of each query head by its KV head's matrix (W_h R_h: the output is rotated back
    through it), then take the unrotated errors. Equal to the rotated errors, and the rotation
    lets an int2 tier of values with an outlier channel lose less."""
    h_kv, rep, d, layer_idx = 3, 2, 16, 5
    layer = _layer(96, h_kv, rep, d, seed)
    chunking = ChunkingConfig(16, 32, 8)
    gen = torch.Generator().manual_seed(100 + seed)
    w_o = torch.randn(24, h_kv * rep * d, generator=gen)
    rot = Rotation(d)
    mats = torch.stack([rot.matrix(layer_idx, h) for h in range(h_kv)])  # [H_kv, D, D]
    q_mats = mats.repeat_interleave(rep, 0)  # query head h * rep + r reads KV head h
    brute_layer = SimpleNamespace(q=torch.einsum("thd,hde->the", layer.q, q_mats),
                                  k=torch.einsum("thd,hde->the", layer.k, mats),
                                  v=torch.einsum("thd,hde->the", layer.v, mats))
    brute_w = torch.cat([w_o[:, i * d:(i + 1) * d] @ q_mats[i] for i in range(h_kv * rep)], 1)
    options = [Option(RowTiers(2, 10), LOW_PRECISIONS["int4"]),
               Option(RowTiers(0, 16), LOW_PRECISIONS["int2"]),
               Option(RowTiers(4, 4), LOW_PRECISIONS["int8"]),
               Option(RowTiers(6), None)]
    scorer = SnapKVScorer()
    for heads in ([0], [2], [0, 1]):
        got = group_errors(layer, heads, options, scorer, chunking, 0.25, w_o, (rot, layer_idx))
        want = group_errors(brute_layer, heads, options, scorer, chunking, 0.25, brute_w)
        plain = group_errors(layer, heads, options, scorer, chunking, 0.25, w_o)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-9)
        assert got[3] == pytest.approx(plain[3], rel=1e-4)  # drop only: nothing quantized
        assert got[1] < plain[1]  # int2 values with an outlier channel lose less rotated


# ---- the searches, end to end -----------------------------------------------------------------

SEARCH_ARGS = ["--samples", "2", "--page-size", "16", "--chunk-size", "32", "--min-tokens", "128",
               "--max-tokens", "128"]


def test_rotated_per_head_search_writes_a_profile_served_rotated(tiny_llama: Path, tmp_path: Path,
                                                                 capsys) -> None:
    out = tmp_path / "mixedr.json"
    assert main(["profile", "tiers", "uniform:0.3", "--model", str(tiny_llama), "--precision",
                 "mixed", "--rotation", "hadamard", "--sens-samples", "1", "-o", str(out),
                 *SEARCH_ARGS]) == 0
    assert "--ragged-rotation hadamard" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["version"] == 4 and data["tiers"]["rotation"] == "hadamard"
    assert data["tiers"]["precision"] == "mixed"
    search = data["stats"]["tier_search"]
    assert search["rotation"] == "hadamard"
    assert search["chosen"] == min(search["candidates"], key=lambda r: r["kl"])["name"]
    config = RaggedConfig(profile=str(out))
    assert (config.precision, config.rotation) == ("mixed", "hadamard")
    assert main(["profile", "show", str(out)]) == 0
    assert "--ragged-precision mixed --ragged-rotation hadamard" in capsys.readouterr().out


def test_rotated_tier_search_scores_rotated_candidates(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """Same samples, same candidates: the rotated search's KLs are another emulation's (rows
    quantized rotated), and it records the rotation."""
    kls = {}
    for rotation in ("none", "hadamard"):
        out = tmp_path / f"int4-{rotation}.json"
        assert main(["profile", "tiers", "uniform:0.5", "--model", str(tiny_llama), "--precision",
                     "int4", "--shares", "0", "--rotation", rotation, "-o", str(out),
                     *SEARCH_ARGS]) == 0
        data = json.loads(out.read_text())
        assert data["version"] == (4 if rotation == "hadamard" else 2)
        assert data["tiers"].get("rotation", "none") == rotation
        kls[rotation] = {r["name"]: r["kl"] for r in data["stats"]["tier_search"]["candidates"]}
    assert kls["none"].keys() == kls["hadamard"].keys()
    assert all(kls["none"][n] != kls["hadamard"][n] for n in kls["none"])
    capsys.readouterr()


def test_a_rotation_the_model_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match="head_dim, got 80; search with --rotation none"):
        rotation_of("hadamard", 80, "search with --rotation none")
    assert rotation_of("none", 80, "x") is None
    with pytest.raises(ValueError, match=r"--rotation 'givens' is unknown"):
        TierSearchConfig(model_path="m", rotation="givens")


# ---- the benches ---------------------------------------------------------------------------------

def test_bench_names_a_rotated_profile_rotated(tmp_path: Path) -> None:
    from bench.accuracy_configs import profile_config

    shipped = SHIPPED / "mixed-uniform-rho0.3.json"
    profile = BudgetProfile.load(shipped)
    path = tmp_path / "mixedr.json"
    rotated(profile).save(path)
    shape = profile.model  # the shipped profile names its model
    own = profile_config(f"a={path}", "snapkv", shape)
    assert own.precision == "mixedr"
    assert own.server_args()[-4:] == ["--ragged-precision", "mixed", "--ragged-rotation", "hadamard"]
    with pytest.raises(ValueError, match="searched for rows stored rotated .* name its precision mixedr"):
        profile_config(f"a={path}=mixed", "snapkv", shape)
    unrotated = profile_config(f"b={shipped}", "snapkv", shape)
    assert unrotated.precision == "mixed" and unrotated.rho == own.rho  # the same bytes
    assert unrotated.server_args()[-2:] == ["--ragged-rotation", "none"]


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("mixed*.json")), ids=lambda p: p.name)
def test_shipped_per_head_profiles_resave_byte_for_byte(path: Path, tmp_path: Path) -> None:
    """Unrotated per-head profiles stay version 3 and rotated ones are version 4, each written
    back byte for byte (an older sgl-ragged keeps reading what it read)."""
    profile = BudgetProfile.load(path)
    out = tmp_path / path.name
    profile.save(out)
    assert out.read_bytes() == path.read_bytes()
    assert json.loads(path.read_text())["version"] == (4 if profile.tiers.rotated else 3)
    assert profile.tiers.rotated == path.name.startswith("mixedr-")
