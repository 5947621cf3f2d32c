"""Low-precision tiers (docs/architecture.md, "Row tiers"): quantization against a brute-force version,
bytes per page for every precision and composition, the default composition rule against a
brute-force search, and tier selection against a brute-force ranking."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ragged import native
from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool import quant
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import (
    FP8_MAX,
    codes_into,
    dequantize,
    pack,
    quantize,
    unpack,
)
from sgl_ragged.mem_pool.tiers import RowTiers, compose, tier_bytes
from sgl_ragged.precision import LOW_PRECISIONS, low_precision
from sgl_ragged.profile import uniform_profile
from sgl_ragged.scoring.select import select_tiers, select_top_k, sink_mask

INT_FORMATS = [p for p in LOW_PRECISIONS.values() if not p.is_float]


def _brute_int(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min/max quantization written out element by element along `dim` groups."""
    levels = 2**bits - 1
    out = torch.empty_like(x)
    moved, res = x.movedim(dim, -1), out.movedim(dim, -1)
    for idx in itertools.product(*(range(n) for n in moved.shape[:-1])):
        group = moved[idx]
        zero = float(torch.tensor(float(group.min())).half())
        scale = float(torch.tensor((float(group.max()) - zero) / levels).half())
        for j, value in enumerate(group.tolist()):
            code = 0 if scale == 0 else min(max(round((value - zero) / scale), 0), levels)
            res[idx][j] = code * scale + zero
    return out


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("seed", range(3))
def test_int_round_trip_matches_brute_force(fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 5, 2, 8, generator=gen) * 3
    v = torch.randn(2, 5, 2, 8, generator=gen)
    got_k, got_v = dequantize(fmt, quantize(fmt, k, v), torch.float32)
    # Keys per channel over the page's tokens (dim 1), values per token over channels (dim 3).
    torch.testing.assert_close(got_k, _brute_int(k, fmt.bits, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, _brute_int(v, fmt.bits, 3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
def test_int_error_is_within_half_a_step(fmt):
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 16, 2, 64, generator=gen), torch.randn(3, 16, 2, 64, generator=gen)
    tier = quantize(fmt, k, v)
    got_k, got_v = dequantize(fmt, tier, torch.float32)
    # half a step, plus float16 rounding of scale and zero
    k_step = tier.k_scale.float()[:, None]
    v_step = tier.v_scale.float()[..., None]
    assert ((got_k - k).abs() <= k_step * 0.5 + 2e-3 * k.abs().amax()).all()
    assert ((got_v - v).abs() <= v_step * 0.5 + 2e-3 * v.abs().amax()).all()


def test_fp8_round_trip_matches_brute_force():
    fmt = LOW_PRECISIONS["fp8"]
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, 2, 8, generator=gen) * 5, torch.randn(2, 6, 2, 8, generator=gen)
    got_k, got_v = dequantize(fmt, quantize(fmt, k, v), torch.float32)
    for x, got, dim in ((k, got_k, 1), (v, got_v, 3)):
        scale = (x.abs().amax(dim, keepdim=True) / FP8_MAX).half().float()
        want = (x / scale).to(torch.float8_e4m3fn).float() * scale
        torch.testing.assert_close(got, want)
        assert ((got - x).abs() <= x.abs() * 2**-3 + 1e-6).all()  # 3 mantissa bits


def test_constant_groups_dequantize_exactly():
    for fmt in INT_FORMATS:
        k = torch.full((1, 4, 1, 8), 0.75)
        v = torch.full((1, 4, 1, 8), -1.5)
        got_k, got_v = dequantize(fmt, quantize(fmt, k, v), torch.float32)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def _hard_inputs(gen: torch.Generator, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Random pages, and the cases rounding decides: constant groups (scale 0), values on
    exact half steps, magnitudes that overflow float16 parameters or fp8 codes, -0.0."""
    x = torch.randn(shape, generator=gen)
    steps = torch.randint(0, 16, shape, generator=gen).float() * 0.5 - 3.0  # half-integers
    flat = x.clone()
    flat[:, :, :1] = 1.25  # a constant head: scale 0 for keys and values alike
    wide = x * 1e4  # float16 scale/zero overflow to inf at 65504
    tiny = x * 1e-6  # float16 subnormal scales
    signs = torch.where(x > 0, 0.0, -0.0)
    return [x, steps, flat, wide, tiny, signs, x.bfloat16().float()]


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
@pytest.mark.parametrize("dim", [1, 3], ids=["keys", "values"])
def test_native_quantizer_equals_torch_bit_for_bit(name, dim):
    """cuda_ext/quantize.cpp's quantize_low (what `quantize` runs on the CPU where the native
    kernels are built: always on the test machine) against the torch `_quantize`: the same
    codes, scales and zero points, bit for bit, on fresh random pages and the hard cases."""
    module = native.load()
    assert quant._quantizer(torch.device("cpu")).func is quant._native_quantize
    fmt = LOW_PRECISIONS[name]
    gen = torch.Generator().manual_seed(40 + dim)
    for shape in [(3, 7, 2, 64), (1, 62, 3, 128), (2, 1, 1, 16)]:
        for x in _hard_inputs(gen, shape):
            got = quant._native_quantize(module, fmt, x, dim)
            want = quant._quantize(fmt, x, dim)
            for g, w in zip(got, want, strict=True):
                if w is None:
                    assert g is None
                    continue
                assert g.shape == w.shape and g.dtype == w.dtype
                # Codes bit for bit; parameters by value (a group of +0.0 and -0.0 may take
                # either as its minimum: torch's reduction order decides, and both decode alike).
                assert torch.equal(g, w), (name, dim, shape)


def test_native_quantizer_refuses_bad_input():
    module = native.load()
    with pytest.raises(RuntimeError, match=r"contiguous float32 CPU tensor \[N, T, H, D\]"):
        module.quantize_low(torch.zeros(2, 3, 4, dtype=torch.bfloat16), 4, False, True)
    with pytest.raises(RuntimeError, match="bits must be 2, 4 or 8"):
        module.quantize_low(torch.zeros(1, 2, 1, 16), 3, False, True)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip_and_layout(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 16), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)
    per = 8 // bits
    for i, j in itertools.product(range(16 // per), range(per)):  # planar: byte i, slot j
        channel = j * (16 // per) + i
        assert torch.equal((packed[..., i] >> (j * bits)) & (2**bits - 1), codes[..., channel])


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_into_writes_code_values_into_any_layout(name, dtype):
    """codes_into = the unpacked codes (fp8: their float8 values) in `dtype`, exactly, also
    into a permuted view; with the parameters applied it is dequantize."""
    fmt = LOW_PRECISIONS[name]
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 5, 3, 16, generator=gen) for _ in range(2))
    tier = quantize(fmt, k, v)
    want = (tier.k_codes.view(torch.float8_e4m3fn).float() if fmt.is_float
            else unpack(tier.k_codes, fmt.bits).float())  # [2, 5, 3, 16]
    out = torch.full((3, 2, 5, 16), float("nan"), dtype=dtype)  # heads first: a permuted view
    codes_into(fmt, tier.k_codes, out.permute(1, 2, 0, 3))
    assert torch.equal(out.permute(1, 2, 0, 3).float(), want)
    zero = 0.0 if tier.k_zero is None else tier.k_zero.float()[:, None]
    got = want * tier.k_scale.float()[:, None] + zero
    torch.testing.assert_close(got, dequantize(fmt, tier, torch.float32)[0], atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(LOW_PRECISIONS))
def test_tier_bytes_count_codes_and_parameters(name):
    fmt = LOW_PRECISIONS[name]
    heads, d = 2, 64
    for tokens in (0, 1, 17, 64):
        params = 2 if fmt.has_zero else 1
        want = 0 if tokens == 0 else (2 * tokens * heads * d * fmt.bits // 8  # K and V codes
                                      + heads * d * params * 2  # key scale/zero per channel
                                      + tokens * heads * params * 2)  # value scale/zero per token
        assert fmt.tier_bytes(tokens, heads, d) == want
        tiers = RowTiers(3, tokens)
        assert tier_bytes(tiers, fmt, heads, d, 2) == 2 * 3 * heads * d * 2 + want


def test_issue_frontier_points():
    """The row formats of the issue's offline table, on SmolLM2's geometry (D 64, bf16)."""
    full = 2 * 64 * 64 * 2  # one head's page
    int4, int2 = LOW_PRECISIONS["int4"], LOW_PRECISIONS["int2"]
    assert tier_bytes(RowTiers(0, 64), int4, 1, 64, 2) / full == pytest.approx(0.281, abs=1e-3)
    assert tier_bytes(RowTiers(0, 64), int2, 1, 64, 2) / full == pytest.approx(0.156, abs=1e-3)
    # rho 0.3 -> 20 full slots of budget: every token int4, the best 2 upgraded
    assert compose(20, 64, 64, 2, int4, 4) == RowTiers(2, 62)
    # rho 0.15 -> 10 full slots of budget: the best 33 tokens int4, the rest dropped
    assert compose(10, 64, 64, 2, int4, 4) == RowTiers(0, 33)
    assert compose(20, 64, 64, 2, None, 4) == RowTiers(20)


def _brute_compose(slots, page, d, dtype_bytes, fmt, min_slots):
    """Exhaustive: among compositions within the budget, prefer the most kept tokens, then the
    most full-precision ones; full precision alone if no mix keeps more tokens than it."""
    budget = 2 * slots * d * dtype_bytes
    best = RowTiers(slots)
    for hi in range(page + 1):
        for lo in range(page + 1 - hi):
            t = RowTiers(hi, lo)
            if tier_bytes(t, fmt, 1, d, dtype_bytes) > budget or t.total < max(min_slots, slots):
                continue
            if (t.total, t.hi) > (best.total, best.hi):
                best = t
    return best


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(4, 32), page=st.sampled_from([8, 16, 32]),
       d=st.sampled_from([8, 16, 64]), dtype_bytes=st.sampled_from([2, 4]),
       name=st.sampled_from(sorted(LOW_PRECISIONS)))
def test_compose_matches_brute_force(slots, page, d, dtype_bytes, name):
    slots = min(slots, page)
    fmt = LOW_PRECISIONS[name]
    got = compose(slots, page, d, dtype_bytes, fmt, 4)
    want = _brute_compose(slots, page, d, dtype_bytes, fmt, 4)
    # The rule keeps every token whenever they all fit; else only low-precision tokens.
    assert got.total == want.total
    if got.total == page:
        assert got == want
    assert tier_bytes(got, fmt, 1, d, dtype_bytes) <= 2 * slots * d * dtype_bytes


@pytest.mark.parametrize("precision", ["bf16", *sorted(LOW_PRECISIONS)])
@pytest.mark.parametrize("ratio", [1.0, 0.7, 0.5, 0.3, 0.2, 0.15])
def test_layout_bytes_per_page_are_the_sum_of_its_rows(precision, ratio):
    profile = uniform_profile(ratio, 3, 3, 1)
    layout = RaggedLayout.from_profile(profile, 64, 64, 2, precision=precision)
    drop_only = RaggedLayout.from_profile(profile, 64, 64, 2)
    fmt = low_precision(precision)
    want = sum(tier_bytes(t, fmt, 1, 64, 2) for layer in layout.tiers for t in layer)
    assert layout.row_bytes_per_page == want
    assert layout.row_bytes_per_page <= drop_only.row_bytes_per_page  # never more bytes
    if fmt is not None and ratio <= 0.3:
        assert min(t.total for layer in layout.tiers for t in layer) > drop_only.slots[0][0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**20), hi=st.integers(0, 8), extra=st.integers(0, 8),
       start=st.sampled_from([0, 8, 64]))
def test_select_tiers_matches_a_brute_force_ranking(seed, hi, extra, start):
    P = 8
    total = min(P, max(hi + extra, 4))
    hi = min(hi, total)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (2, 3, P), generator=gen).float()  # ties on purpose
    sinks = sink_mask(torch.tensor([start, start + P]), P)
    hi_idx, lo_idx = select_tiers(scores, hi, total, sinks)
    for n, h in itertools.product(range(2), range(3)):
        # rank: sinks first (in position order), then by score descending, ties to the
        # earlier position
        ranked = sorted(range(P), key=lambda i: (not bool(sinks[n, i]),
                                                 0.0 if sinks[n, i] else -float(scores[n, h, i]), i))
        assert hi_idx[n, h].tolist() == sorted(ranked[:hi])
        assert lo_idx[n, h].tolist() == sorted(ranked[hi:total])
    assert torch.equal(select_tiers(scores, total, total, sinks)[0], select_top_k(scores, total, sinks))


def test_config_refuses_bad_precisions():
    with pytest.raises(ValueError, match=r"--ragged-precision 'int3' is unknown; choose one of"):
        RaggedConfig(profile="uniform:0.3", precision="int3")
    with pytest.raises(ValueError, match="cannot be combined with the dynamic reference mode"):
        RaggedConfig(profile="dynamic:0.3", precision="int4")
    assert RaggedConfig.from_env({"RAGGED_PROFILE": "uniform:0.3",
                                  "RAGGED_PRECISION": "INT4"}).precision == "int4"
    assert RaggedConfig(profile="uniform:0.3").precision == "bf16"


@pytest.mark.parametrize("precision", sorted(LOW_PRECISIONS))
def test_sealed_rows_hold_the_best_tokens_then_the_next_ones_quantized(precision):
    """RaggedStorage.write_sealed + page_kv against a brute force: per (page, head), the hi best tokens by
    score (sinks first) exactly, then the next lo ones quantized and dequantized."""
    from sgl_ragged.mem_pool.storage import RaggedStorage
    from sgl_ragged.profile import BudgetProfile
    from sgl_ragged.scoring import SnapKVScorer

    P, D, H = 16, 16, 4
    profile = BudgetProfile(model=None, budgets=[[0.25, 0.25, 0.5, 0.5]],
                            groups=[((0, 1), (2, 3))], source={"kind": "uniform"})
    layout = RaggedLayout.from_profile(profile, P, D, 4, precision=precision)
    assert any(t.lo for t in layout.tiers[0])
    storage = RaggedStorage(layout, 8, 2, torch.float32, "cpu", SnapKVScorer())
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, P, H, D, generator=gen), torch.randn(3, P, H, D, generator=gen)
    scores = torch.rand(3, H, P, generator=gen)
    pages, starts = torch.tensor([5, 2, 7]), torch.tensor([0, P, 2 * P])
    storage.write_sealed(0, pages, k, v, storage.sealer.choose(scores, starts))
    fmt = LOW_PRECISIONS[precision]
    sinks = sink_mask(starts, P)
    for g, (heads, t) in enumerate(zip(layout.groups[0], layout.tiers[0], strict=True)):
        got_k, got_v = storage.page_kv(0, g, pages)  # [3, k, H_p, D]
        assert got_k.shape == (3, t.total, len(heads), D)
        lo_k = torch.empty(3, t.lo, len(heads), D)
        lo_v = torch.empty(3, t.lo, len(heads), D)
        for n, (j, h) in itertools.product(range(3), enumerate(heads)):
            ranked = sorted(range(P), key=lambda i, n=n, h=h: (
                not bool(sinks[n, i]), 0.0 if sinks[n, i] else -float(scores[n, h, i]), i))
            hi, lo = sorted(ranked[: t.hi]), sorted(ranked[t.hi : t.total])
            torch.testing.assert_close(got_k[n, : t.hi, j], k[n, hi, h])
            torch.testing.assert_close(got_v[n, : t.hi, j], v[n, hi, h])
            lo_k[n, :, j], lo_v[n, :, j] = k[n, lo, h], v[n, lo, h]
        # The low tier of the group's page quantized together (key parameters per channel
        # over each head's lo tokens of the page).
        want_k, want_v = dequantize(fmt, quantize(fmt, lo_k, lo_v), torch.float32)
        torch.testing.assert_close(got_k[:, t.hi :], want_k)
        torch.testing.assert_close(got_v[:, t.hi :], want_v)
    assert storage.nbytes() >= 8 * layout.row_bytes_per_page  # rows (incl. parameters) counted


def _tiered_profile(hi: float, lo: float):
    from sgl_ragged.profile import BudgetProfile, ProfileTiers

    base = uniform_profile(0.3, 2, 3, 1)
    tiers = ProfileTiers("int4", [[hi] * 3] * 2, [[lo] * 3] * 2)
    return BudgetProfile(base.model, base.budgets, base.groups, base.source, tiers=tiers)


def test_profile_tiers_round_trip_and_drive_the_layout(tmp_path):
    from sgl_ragged.profile import BudgetProfile

    profile = _tiered_profile(4 / 64, 40 / 64)
    path = tmp_path / "tiered.json"
    profile.save(path)
    loaded = BudgetProfile.load(path)
    assert loaded.tiers == profile.tiers
    layout = RaggedLayout.from_profile(loaded, 64, 64, 2, precision="int4")
    assert {(t.hi, t.lo) for layer in layout.tiers for t in layer} == {(4, 40)}
    # another precision, or none, ignores the stored compositions
    rule = RaggedLayout.from_profile(loaded, 64, 64, 2, precision="int8")
    assert {(t.hi, t.lo) for layer in rule.tiers for t in layer} != {(4, 40)}
    assert not RaggedLayout.from_profile(loaded, 64, 64, 2).quantized


def test_version_1_files_still_load_and_bad_tiers_are_refused(tmp_path):
    import json as _json
    from pathlib import Path

    from sgl_ragged.profile import BudgetProfile, ProfileError, ProfileTiers

    shipped = Path(__file__).parents[2] / "calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json"
    assert _json.loads(shipped.read_text())["version"] == 1
    assert BudgetProfile.load(shipped).tiers is None
    data = _tiered_profile(0.1, 0.5).to_dict()
    data["version"] = 1  # version 1 has no tiers
    with pytest.raises(ProfileError, match="unknown key"):
        BudgetProfile.from_dict(data)
    base = uniform_profile(0.3, 2, 3, 3)  # one group of all 3 heads per layer
    for tiers, message in ((ProfileTiers("int3", [[0.1] * 3] * 2, [[0.5] * 3] * 2), "not one of"),
                           (ProfileTiers("int4", [[0.6] * 3] * 2, [[0.5] * 3] * 2), "shares of a page"),
                           (ProfileTiers("int4", [[0.1, 0.2, 0.1]] * 2, [[0.5] * 3] * 2), "different compositions")):
        with pytest.raises(ProfileError, match=message):
            BudgetProfile(base.model, base.budgets, base.groups, base.source, tiers=tiers)


def test_a_full_budget_buys_full_precision():
    """At uniform:1.0 every precision keeps every token at the model dtype (no low tier)."""
    for name in LOW_PRECISIONS:
        for dtype_bytes in (2, 4):
            assert compose(64, 64, 64, dtype_bytes, LOW_PRECISIONS[name], 4) == RowTiers(64)
