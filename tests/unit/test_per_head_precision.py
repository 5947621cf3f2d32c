"""Per-head precision (--ragged-precision mixed, issue 20 item 3): each group's low tier in its
own format through the layout's bytes, the storage, page_kv / page_tiers, the batched path and
the registry; the profile's per-head formats (format version 3) and old profiles; the
byte allocator against a brute force and the whole search on a tiny random model."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention
from sgl_ragged.attention_backend.native_impl import NativeAttention
from sgl_ragged.attention_backend.registry import make_attention_impl, triton_refuses
from sgl_ragged.calibrate.knapsack import allocate
from sgl_ragged.calibrate.precision_search import Option, group_options
from sgl_ragged.cli import main
from sgl_ragged.config import RaggedConfig
from sgl_ragged.emulator.compressed import TierSelection
from sgl_ragged.kernels.aot import layout_split_ratios
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import dequantize, quantize
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.mem_pool.tiers import RowTiers, compose, tier_bytes
from sgl_ragged.precision import LOW_PRECISIONS, tier_precision
from sgl_ragged.profile import (
    BudgetProfile,
    ProfileError,
    ProfileTiers,
    model_shape,
    uniform_profile,
)
from sgl_ragged.scoring import SnapKVScorer

from .kernel_cases import Spec, compare_with_reference, random_specs

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("int8", "int4", "int2")


def mixed_profile(layers: int = 2, heads: int = 4, heads_per_group: int = 2,
                  seed: int = 0) -> BudgetProfile:
    """uniform:0.5 with per-group compositions (shares of an 8-token page, one group without a
    low tier) and formats (every format present), rotated by `seed`."""
    base = uniform_profile(0.5, layers, heads, heads_per_group)
    hi = [[0.0] * heads for _ in range(layers)]
    lo = [[0.0] * heads for _ in range(layers)]
    fmts = [["int4"] * heads for _ in range(layers)]
    pairs = itertools.islice(itertools.cycle([(1, 3), (2, 4), (4, 0), (1, 6), (4, 4)]), seed, None)
    names = itertools.islice(itertools.cycle(FORMATS), seed, None)
    for li, layer_groups in enumerate(base.groups):
        for heads_g in layer_groups:
            h_n, l_n = next(pairs)
            f = next(names) if l_n else "int4"
            for h in heads_g:
                hi[li][h], lo[li][h], fmts[li][h] = h_n / 8, l_n / 8, f
    return BudgetProfile(base.model, base.budgets, base.groups, base.source,
                         tiers=ProfileTiers("mixed", hi, lo, fmts))


def mixed_storage(profile: BudgetProfile, head_dim: int = 16, dtype: torch.dtype = torch.float32,
                  ) -> RaggedStorage:
    layout = RaggedLayout.from_profile(profile, 8, head_dim, torch.finfo(dtype).bits // 8, "mixed")
    return RaggedStorage(layout, 12, 4, dtype, "cpu", SnapKVScorer())


# ---- the layout's bytes and the storage -----------------------------------------------------

def test_mixed_layout_counts_each_groups_bytes_in_its_format():
    profile = mixed_profile()
    layout = RaggedLayout.from_profile(profile, 8, 16, 2, "mixed")
    assert layout.mixed_formats and layout.precision_name == "mixed"
    want = 0
    for li, layer_groups in enumerate(profile.groups):
        for g, heads in enumerate(layer_groups):
            h = heads[0]
            t = RowTiers(round(profile.tiers.hi[li][h] * 8), round(profile.tiers.lo[li][h] * 8))
            fmt = LOW_PRECISIONS[profile.tiers.formats[li][h]]
            assert layout.tiers[li][g] == t
            assert layout.low_format(li, g) == (fmt if t.lo else None)
            want += tier_bytes(t, fmt, len(heads), 16, 2)
    assert layout.row_bytes_per_page == want
    for li, ratios in enumerate(layout_split_ratios(layout)):  # the byte-weighted split map
        work = [layout.group_bytes(li, g) for g in range(len(layout.groups[li]))]
        assert ratios == pytest.approx([w / sum(work) for w in work])


def test_one_format_everywhere_is_the_plain_layout():
    profile = mixed_profile()
    same = profile.tiers.formats and [["int4"] * 4 for _ in range(2)]
    uniform = BudgetProfile(profile.model, profile.budgets, profile.groups, profile.source,
                            tiers=ProfileTiers("mixed", profile.tiers.hi, profile.tiers.lo, same))
    layout = RaggedLayout.from_profile(uniform, 8, 16, 2, "mixed")
    assert not layout.mixed_formats and layout.low == LOW_PRECISIONS["int4"]


def test_storage_allocates_each_groups_tier_in_its_format_and_page_kv_round_trips():
    storage = mixed_storage(mixed_profile())
    layout = storage.layout
    gen = torch.Generator().manual_seed(3)
    pages = torch.tensor([2, 5, 7])
    seen = set()
    for li, layer_groups in enumerate(layout.groups):
        for g, heads in enumerate(layer_groups):
            t, fmt, tier = layout.tiers[li][g], layout.low_format(li, g), storage.low_rows[li][g]
            assert (tier is None) == (t.lo == 0)
            if tier is None:
                continue
            seen.add(fmt.name)
            assert tier.k_codes.shape == (12, t.lo, len(heads), fmt.code_bytes(16))
            hi_k, hi_v, lo_k, lo_v = (torch.randn(3, n, len(heads), 16, generator=gen)
                                      for n in (t.hi, t.hi, t.lo, t.lo))
            storage.write_group(li, g, pages, hi_k, hi_v)
            storage.write_low(li, g, pages, lo_k, lo_v)
            want_k, want_v = dequantize(fmt, quantize(fmt, lo_k, lo_v), torch.float32)
            k, v = storage.page_kv(li, g, pages)
            torch.testing.assert_close(k, torch.cat([hi_k, want_k], 1))
            torch.testing.assert_close(v, torch.cat([hi_v, want_v], 1))
            raw = storage.page_tiers(li, g, pages).low
            torch.testing.assert_close(dequantize(fmt, raw, torch.float32)[0], want_k)
    assert seen == set(FORMATS)


def test_storage_bytes_per_page_are_the_layouts():
    """Rows and tiers of one logical page take exactly row_bytes_per_page (dtype bytes 4)."""
    storage = mixed_storage(mixed_profile(seed=5))
    tensors = [x for layer in storage.low_rows for tier in layer if tier is not None
               for x in tier.tensors()]
    tensors += [x for r in (storage.rows_k, storage.rows_v) for layer in r for x in layer]
    per_page = sum(x.numel() * x.element_size() for x in tensors) // storage.num_pages
    assert per_page == storage.layout.row_bytes_per_page


# ---- serving paths ----------------------------------------------------------------------------

@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_matches_the_reference_on_mixed_formats(decode, seed):
    rng = random.Random(seed)
    specs = random_specs(rng, 3, decode) + [Spec(sealed=2, staged=3, q_len=1 if decode else 4)]
    compare_with_reference(BatchedTorchAttention, specs, decode, seed, "cpu", layer=1,
                           precision="mixed")


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_native_matches_the_reference_on_mixed_formats(decode, seed):
    """The native kernels read each group's low format (native_impl._group_formats), prefill
    chunks included."""
    rng = random.Random(10 + seed)
    specs = random_specs(rng, 3, decode) + [Spec(sealed=2, staged=3, q_len=1 if decode else 4)]
    compare_with_reference(lambda st: NativeAttention(st, extend_on_batched=False), specs, decode,
                           10 + seed, "cpu", layer=seed, precision="mixed")


def test_registry_serves_mixed_formats_on_every_path(caplog):
    """auto on a CPU picks the native kernels (built on the test machine), which read a format
    per group as batched and the reference do; Triton reads them too, one launch per format
    (tables.format_parts), and refuses only for want of a GPU or a power-of-two head size."""
    storage = mixed_storage(mixed_profile())
    with caplog.at_level("WARNING"):
        assert isinstance(make_attention_impl(storage, None, "auto"), NativeAttention)
    assert "one per head group" not in caplog.text
    assert isinstance(make_attention_impl(storage, None, "batched"), BatchedTorchAttention)
    assert type(make_attention_impl(storage, None, "reference")).__name__ == "TorchAttention"
    with pytest.raises(ValueError, match="--ragged-attention triton needs a CUDA device"):
        make_attention_impl(storage, None, "triton")
    assert triton_refuses(64, "mixed") is None
    assert "power-of-two" in triton_refuses(48, "mixed")


# ---- the profile and what the server accepts ---------------------------------------------

def test_profile_round_trip_writes_version_3(tmp_path):
    profile = mixed_profile()
    path = tmp_path / "mixed.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 3 and data["tiers"]["precision"] == "mixed"
    assert BudgetProfile.load(path) == profile
    data["version"] = 2  # version 2 has no per-head formats
    with pytest.raises(ProfileError, match="from format version 3, formats"):
        BudgetProfile.from_dict(data)


@pytest.mark.parametrize("name", ["int4-uniform-rho0.3.json", "snapkv-rho0.3.json"])
def test_shipped_old_profiles_load_and_resave_byte_identically(name, tmp_path):
    path = ROOT / "calib_profiles/smollm2-135m-instruct" / name
    profile = BudgetProfile.load(path)
    assert profile.tiers is None or not profile.tiers.per_head
    out = tmp_path / name
    profile.save(out)
    if json.loads(path.read_text())["version"] == 2:
        assert out.read_bytes() == path.read_bytes()
    assert BudgetProfile.load(out) == profile


def test_bad_per_head_precisions_are_refused_with_clear_errors():
    profile = mixed_profile()
    tiers = profile.tiers
    bad = [list(row) for row in tiers.formats]
    bad[1][2] = "int3"
    with pytest.raises(ProfileError, match=r"tiers.formats\[1\]\[2\] = 'int3' is not a low precision"):
        BudgetProfile(profile.model, profile.budgets, profile.groups, profile.source,
                      tiers=ProfileTiers("mixed", tiers.hi, tiers.lo, bad))
    split = [list(row) for row in tiers.formats]
    split[0][1] = "int8" if split[0][0] != "int8" else "int4"  # heads 0 and 1 share a group
    with pytest.raises(ProfileError, match="different compositions"):
        BudgetProfile(profile.model, profile.budgets, profile.groups, profile.source,
                      tiers=ProfileTiers("mixed", tiers.hi, tiers.lo, split))
    with pytest.raises(ProfileError, match="needs tiers.formats"):
        ProfileTiers("mixed", tiers.hi, tiers.lo).check(2, profile.groups)
    with pytest.raises(ProfileError, match="only read with tiers.precision 'mixed'"):
        ProfileTiers("int4", tiers.hi, tiers.lo, tiers.formats).check(2, profile.groups)
    # an int2 group needs head_dim % 4 == 0: a head size the server cannot pack
    with pytest.raises(ValueError, match="per-head precision int2 .* head_dim 6"):
        RaggedLayout.from_profile(profile, 8, 6, 2, "mixed")


def test_ragged_precision_must_agree_with_the_profile():
    profile = mixed_profile()
    with pytest.raises(ValueError, match="serve it with --ragged-precision mixed, not int4"):
        RaggedLayout.from_profile(profile, 8, 16, 2, "int4")
    with pytest.raises(ValueError, match="serve it with --ragged-precision mixed, not bf16"):
        RaggedLayout.from_profile(profile, 8, 16, 2)
    with pytest.raises(ValueError, match="this profile has none"):
        RaggedLayout.from_profile(uniform_profile(0.5, 2, 4, 2), 8, 16, 2, "mixed")
    assert tier_precision("mixed").name == "mixed"


@pytest.mark.parametrize("name,want", [("mixed-uniform-rho0.3.json", "mixed"),
                                       ("int4-uniform-rho0.3.json", "int4"),
                                       ("snapkv-rho0.3.json", "bf16")])
def test_ragged_precision_defaults_to_what_the_profile_was_written_for(name, want, tmp_path):
    """Without --ragged-precision (auto) a profile file serves the precision its tiers were
    searched for (mixed: per-head formats; a `profile tiers` file: its one precision), and a
    profile without tiers, a model-free spec or a file that does not load (reported later, with
    the model) bf16; an explicit flag wins, and the environment's form resolves the same."""
    path = str(ROOT / "calib_profiles/smollm2-135m-instruct" / name)
    assert RaggedConfig(profile=path).precision == want
    assert RaggedConfig.from_env({"RAGGED_PROFILE": path}).precision == want
    assert RaggedConfig(profile=path, precision="AUTO").precision == want
    for spec in ("uniform:0.3", "dynamic:0.3", str(tmp_path / "missing.json")):
        assert RaggedConfig(profile=spec).precision == "bf16"
    if want != "mixed":  # a per-head profile is refused at another precision (above)
        assert RaggedConfig(profile=path, precision="int8").precision == "int8"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert RaggedConfig(profile=str(bad)).precision == "bf16"


def test_a_quantized_high_tier_is_not_combined_with_per_group_formats():
    layout = RaggedLayout.from_profile(mixed_profile(), 8, 16, 2, "mixed")
    with pytest.raises(ValueError, match="a quantized high tier"):
        RaggedLayout(8, 16, 2, layout.groups, layout.slots, layout.tiers, layout.low,
                     LOW_PRECISIONS["int8"], layout.low_formats)


# ---- the emulator and the search ---------------------------------------------------------------

def test_tier_selection_with_one_format_per_head_equals_the_uniform_one():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 2, 16, generator=gen)
    sinks = torch.zeros(3, 16, dtype=torch.bool)
    sinks[0, :4] = True
    k, v = torch.randn(3, 16, 2, 8, generator=gen), torch.randn(3, 16, 2, 8, generator=gen)
    tiers = [[RowTiers(2, 6), RowTiers(2, 6)]]
    fmt, other = LOW_PRECISIONS["int4"], LOW_PRECISIONS["int2"]
    plain = TierSelection(tiers, fmt).sealed_kv(0, scores, sinks, k, v)
    per_head = TierSelection(tiers, None, formats=[[fmt, fmt]]).sealed_kv(0, scores, sinks, k, v)
    for a, b in zip(plain, per_head, strict=True):
        torch.testing.assert_close(a, b)
    mixed = TierSelection(tiers, None, formats=[[fmt, other]]).sealed_kv(0, scores, sinks, k, v)
    torch.testing.assert_close(mixed[0][:, :, 0], plain[0][:, :, 0])  # head 0: int4 as before
    solo = TierSelection([[RowTiers(2, 6)]], other).sealed_kv(0, scores[:, 1:], sinks, k[:, :, 1:],
                                                               v[:, :, 1:])
    torch.testing.assert_close(mixed[0][:, :, 1:], solo[0])  # head 1: int2


@pytest.mark.parametrize("seed", range(12))
def test_allocator_matches_brute_force(seed):
    rng = random.Random(seed)
    groups = rng.randint(1, 4)
    costs = [[rng.randrange(0, 40, rng.choice([1, 2, 4])) for _ in range(rng.randint(1, 4))]
             for _ in range(groups)]
    errors = [[rng.random() for _ in cs] for cs in costs]
    budget = sum(min(cs) for cs in costs) + rng.randint(0, 60)
    got = allocate(costs, errors, budget)
    best = min((sum(errors[g][i] for g, i in enumerate(pick)), pick)
               for pick in itertools.product(*(range(len(cs)) for cs in costs))
               if sum(costs[g][i] for g, i in enumerate(pick)) <= budget)
    assert got.error == pytest.approx(best[0])
    assert got.bytes == sum(costs[g][i] for g, i in enumerate(got.choice)) <= budget
    assert got.error == pytest.approx(sum(errors[g][i] for g, i in enumerate(got.choice)))


def test_allocator_refuses_an_impossible_budget():
    with pytest.raises(ValueError, match="over the budget"):
        allocate([[5, 7], [3]], [[0.1, 0.0], [0.0]], 7)


def test_group_options_keep_the_sinks_and_hold_each_rule():
    fmts = [LOW_PRECISIONS[f] for f in FORMATS]
    for slots in (4, 10, 20, 32, 64):
        opts = group_options(64, slots, 64, 2, fmts)
        assert all(4 <= o.tiers.total <= 64 for o in opts)
        assert all((o.fmt is None) == (o.tiers.lo == 0) for o in opts)
        assert Option(RowTiers(slots), None) in opts
        for fmt in fmts:
            rule = compose(slots, 64, 64, 2, fmt, 4)
            assert Option(rule, fmt if rule.lo else None) in opts


def test_mixed_search_cli_writes_a_profile_the_server_layout_reads(tiny_llama: Path, tmp_path: Path,
                                                                   capsys):
    out = tmp_path / "mixed.json"
    assert main(["profile", "tiers", "uniform:0.3", "--model", str(tiny_llama), "--precision",
                 "mixed", "-o", str(out), "--samples", "2", "--sens-samples", "1",
                 "--page-size", "16", "--chunk-size", "32", "--min-tokens", "128",
                 "--max-tokens", "128"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["version"] == 3 and data["tiers"]["precision"] == "mixed"
    assert data["groups"] == [[[0], [1]]] * 2  # --heads-per-group 1: a format per KV head
    search = data["stats"]["tier_search"]
    rows = {r["name"]: r for r in search["candidates"]}
    assert set(rows) == {"knapsack", "rule:int8", "rule:int4", "rule:int2"} and "<- chosen" in printed
    assert search["chosen"] == min(rows, key=lambda n: rows[n]["kl"])
    budget = 2 * 5 * 16 * 2 / (2 * 16 * 16 * 2)  # uniform:0.3 of a 16-token page: 5 slots
    assert all(r["kl"] > 0 and r["bytes"] <= budget + 1e-9 for r in rows.values())
    assert rows["rule:int4"]["kl_vs_int4"] == 0.0
    profile = BudgetProfile.load(out)
    shape = model_shape(str(tiny_llama))
    assert profile.model == shape  # its slots follow this model's head_dim: it names it
    layout = RaggedLayout.from_profile(profile, 16, shape.head_dim, 2, "mixed")
    assert layout.retention == pytest.approx(rows[search["chosen"]]["bytes"])
    assert main(["profile", "show", str(out)]) == 0


def test_tensor_parallel_ranks_keep_their_heads_compositions_and_formats():
    from sgl_ragged.tp import slice_all

    profile = mixed_profile()  # 4 heads in groups (0, 1), (2, 3): one group per rank
    for rank, part in enumerate(slice_all(profile, 2)):
        heads = (2 * rank, 2 * rank + 1)
        for li in range(2):
            assert part.tiers.formats[li] == tuple(profile.tiers.formats[li][h] for h in heads)
            assert part.tiers.lo[li] == tuple(profile.tiers.lo[li][h] for h in heads)
        RaggedLayout.from_profile(part, 8, 16, 2, "mixed")  # each rank lays its rows out


SHIPPED_MIXED = sorted((ROOT / "calib_profiles/smollm2-135m-instruct").glob("mixed-*.json"))


@pytest.mark.parametrize("path", SHIPPED_MIXED, ids=[p.name for p in SHIPPED_MIXED])
def test_shipped_mixed_profiles_serve_at_their_bytes(path):
    """Each shipped per-head profile lays out (SmolLM2: 30 layers, 3 KV heads, head_dim 64, bf16)
    at the chosen candidate's bytes, within what its drop-only rows cost."""
    profile = BudgetProfile.load(path)
    search = profile.stats["tier_search"]
    layout = RaggedLayout.from_profile(profile, 64, 64, 2, "mixed")
    drop_only = RaggedLayout.from_profile(uniform_profile(profile.source["rho"], 30, 3, 1), 64, 64, 2)
    chosen = next(c for c in search["candidates"] if c["name"] == search["chosen"])
    assert layout.retention == pytest.approx(chosen["bytes"])
    assert layout.row_bytes_per_page <= drop_only.row_bytes_per_page


def test_a_tier_profile_refuses_another_grouping(tmp_path: Path):
    """--ragged-heads-per-group on a profile with searched tiers (profile/spec.py, the server's
    path): the same grouping keeps it, another is refused by name (regrouping would silently
    drop its compositions and formats)."""
    from sgl_ragged.profile import ModelShape, ProfileError, resolve_profile

    path = tmp_path / "mixed.json"
    mixed_profile().save(path)  # groups of 2
    shape = ModelShape("LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_dim=16)
    assert resolve_profile(str(path), shape, 2) == BudgetProfile.load(path)
    for hpg in (1, 4):
        with pytest.raises(ProfileError, match=rf"row tiers searched for head groups of 2 .* "
                                               rf"regrouping to {hpg} heads per group .* "
                                               rf"--heads-per-group {hpg}"):
            resolve_profile(str(path), shape, hpg)
    # One low format for all (version 2, `profile tiers --precision int4`): the same refusal,
    # pointing at a regrouped base profile (that search takes no --heads-per-group).
    mixed = mixed_profile()
    one_format = BudgetProfile(mixed.model, mixed.budgets, mixed.groups, mixed.source,
                               tiers=ProfileTiers("int4", mixed.tiers.hi, mixed.tiers.lo))
    with pytest.raises(ProfileError, match=r"regrouping to 1 heads per group .*\(`sgl-ragged "
                                           r"profile tiers` on a profile in groups of 1\)"):
        one_format.regrouped(1)
