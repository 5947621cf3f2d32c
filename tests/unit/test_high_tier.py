"""A quantized high tier in the server (--ragged-precision H+L, docs/architecture.md, "Row tiers"): the
precision names, the layout's bytes and compositions against brute forces, the storage's write /
read round trip, the torch reference against brute-force attention over dequantized tokens, the
emulator (TierSelection.hi_fmt) and the server storing the same values, and which attention
paths read or refuse such rows (the Triton kernels' reading and sealing: tests/unit/test_kernels_*.py)."""

from __future__ import annotations

import itertools
import logging
import math
import random

import pytest
import torch

from sgl_ragged.attention_backend.registry import (
    HIGH_TIER_READERS,
    IMPLEMENTATIONS,
    make_attention_impl,
    triton_refuses,
)
from sgl_ragged.config import RaggedConfig
from sgl_ragged.emulator.compressed import TierSelection, head_tiers
from sgl_ragged.kernels.aot import layout_split_ratios
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import dequantize, quantize
from sgl_ragged.mem_pool.tiers import RowTiers, compose_mixed
from sgl_ragged.precision import LOW_PRECISIONS, LowPrecision, tier_precision
from sgl_ragged.profile import BudgetProfile, uniform_profile
from sgl_ragged.scoring import SINK_TOKENS
from sgl_ragged.scoring.select import select_tiers, sink_mask
from tests.unit import test_ragged_attention as tra
from tests.unit.kernel_cases import make_storage

PAIRS = ["int8+int4", "int8+int2", "int8+int8", "int8+fp8", "fp8+int4", "fp8+int2", "fp8+fp8"]


# ---- names ---------------------------------------------------------------------------------


def test_names_parse_and_bad_ones_say_why() -> None:
    assert tier_precision("int8+int4").name == "int8+int4"
    assert tier_precision("bf16+int4") == tier_precision("int4")  # today's layouts
    assert tier_precision("bf16").low is None and tier_precision("int4").high is None
    assert RaggedConfig(profile="uniform:0.5", precision="bf16+int2").precision == "int2"
    assert RaggedConfig(profile="uniform:0.5", precision="fp8+int4").precision == "fp8+int4"
    for bad in ("int4+int2", "int2+int2", "bf16+bf16", "int8+int4+int2", "int8+int3", "+int4"):
        with pytest.raises(ValueError, match="is unknown; a pair is <high>"):
            tier_precision(bad)
    with pytest.raises(ValueError, match="fp8 costs less per token than the low tier's int8"):
        RaggedConfig(profile="uniform:0.5", precision="fp8+int8")
    with pytest.raises(ValueError, match="cannot be combined with the dynamic reference mode"):
        RaggedConfig(profile="dynamic:0.5", precision="int8+int4")


# ---- bytes and compositions ----------------------------------------------------------------


def _tier_cost(fmt: LowPrecision, n: int, heads: int, d: int) -> int:
    """One tier written out: K and V codes, per key channel a scale (and a zero), per value
    token a scale (and a zero), all float16; nothing for an empty tier."""
    params = 1 if fmt.name == "fp8" else 2
    return 0 if n == 0 else heads * (2 * n * d * fmt.bits // 8 + d * params * 2 + n * params * 2)


def _brute_compose(slots: int, page: int, d: int, hi: LowPrecision, lo: LowPrecision) -> RowTiers:
    """Among every (hi, lo) within the budget: the most tokens, then the most hi ones."""
    budget = 2 * slots * d * 2
    fits = [(a + b, a) for a in range(page + 1) for b in range(page + 1 - a)
            if _tier_cost(hi, a, 1, d) + _tier_cost(lo, b, 1, d) <= budget]
    total, a = max(fits)
    return RowTiers(a, total - a)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("d", [32, 64])
def test_compositions_are_the_brute_force(pair: str, d: int) -> None:
    fmt = tier_precision(pair)
    for slots in range(SINK_TOKENS, 65):
        want = _brute_compose(slots, 64, d, fmt.high, fmt.low)
        assert compose_mixed(slots, 64, d, 2, fmt.high, fmt.low, SINK_TOKENS) == want


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.3, 0.15])
def test_layout_bytes_are_the_sum_of_its_tiers(pair: str, ratio: float) -> None:
    profile = BudgetProfile(model=None, budgets=[[ratio, ratio / 2, ratio, 1.0]] * 2,
                            groups=[((0, 1), (2, 3))] * 2, source={"kind": "uniform"})
    layout = RaggedLayout.from_profile(profile, 64, 64, 2, precision=pair)
    drop_only = RaggedLayout.from_profile(profile, 64, 64, 2)
    fmt = tier_precision(pair)
    assert layout.high == fmt.high and layout.low == fmt.low and layout.precision_name == pair
    want = [[_tier_cost(fmt.high, t.hi, len(h), 64) + _tier_cost(fmt.low, t.lo, len(h), 64)
             for h, t in zip(gs, ts, strict=True)] for gs, ts in zip(layout.groups, layout.tiers, strict=True)]
    assert layout.row_bytes_per_page == sum(map(sum, want))
    assert layout.row_bytes_per_page <= drop_only.row_bytes_per_page
    for w, ratios in zip(want, layout_split_ratios(layout), strict=True):  # byte-weighted splits
        assert ratios == pytest.approx([x / sum(w) for x in w])


def test_half_the_bytes_is_the_emulators_52_int8_and_12_int4() -> None:
    layout = RaggedLayout.from_profile(uniform_profile(0.5, 30, 3), 64, 64, 2, "int8+int4")
    assert {(t.hi, t.lo) for layer in layout.tiers for t in layer} == {(52, 12)}
    assert "int8+int4: 52.0 int8 + 12.0 int4 slots per page (mean)" == layout.describe_tiers()
    assert 0.45 < layout.retention <= 0.5


# ---- storage -------------------------------------------------------------------------------

P, D, H = 16, 16, 4


def _sealed(precision: str, seed: int):
    """A float32 storage whose 3 pages 5, 2, 7 were sealed from random K/V and scores."""
    profile = BudgetProfile(model=None, budgets=[[0.25, 0.25, 0.4, 0.7]],
                            groups=[((0, 1), (2, 3))], source={"kind": "uniform"})
    storage = make_storage(profile, P, D, 8, 2, precision=precision)
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(3, P, H, D, generator=gen), torch.randn(3, P, H, D, generator=gen)
    scores = torch.rand(3, H, P, generator=gen)
    pages, starts = torch.tensor([5, 2, 7]), torch.tensor([0, P, 2 * P])
    storage.write_sealed(0, pages, k, v, storage.sealer.choose(scores, starts))
    return storage, pages, starts, k, v, scores


def _ranked(scores: torch.Tensor, sinks: torch.Tensor) -> list[int]:
    """Token offsets of one (page, head) best first: sinks, then score, ties to the earlier."""
    return sorted(range(len(scores)), key=lambda i: (not bool(sinks[i]),
                                                     0.0 if sinks[i] else -float(scores[i]), i))


def _roundtrip(fmt: LowPrecision, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's tier k, v [n, D] quantized on its own and read back."""
    qk, qv = dequantize(fmt, quantize(fmt, k[None, :, None], v[None, :, None]), torch.float32)
    return qk[0, :, 0], qv[0, :, 0]


@pytest.mark.parametrize("pair", ["int8+int4", "fp8+int2", "fp8+int4"])
@pytest.mark.parametrize("seed", [0, 1])
def test_sealed_rows_round_trip_per_head(pair: str, seed: int) -> None:
    """RaggedStorage.write_sealed + page_kv against a brute force per (page, head): the hi best tokens (sinks
    first) quantized in H, the next lo ones in L, each tier with its own parameters."""
    storage, pages, starts, k, v, scores = _sealed(pair, seed)
    layout, fmt = storage.layout, tier_precision(pair)
    assert any(t.hi and t.lo for t in layout.tiers[0])
    assert all(x.shape[1] == 0 for x in storage.rows_k[0])  # nothing at the model dtype
    sinks = sink_mask(starts, P)
    for g, (heads, t) in enumerate(zip(layout.groups[0], layout.tiers[0], strict=True)):
        got_k, got_v = storage.page_kv(0, g, pages)  # [3, k, H_p, D]
        assert got_k.shape == (3, t.total, len(heads), D)
        for n, (j, h) in itertools.product(range(3), enumerate(heads)):
            ranked = _ranked(scores[n, h], sinks[n])
            for sl, idx, f in ((slice(0, t.hi), sorted(ranked[: t.hi]), fmt.high),
                               (slice(t.hi, t.total), sorted(ranked[t.hi: t.total]), fmt.low)):
                if not idx:
                    continue
                want_k, want_v = _roundtrip(f, k[n, idx, h], v[n, idx, h])
                torch.testing.assert_close(got_k[n, sl, j], want_k, rtol=0, atol=0)
                torch.testing.assert_close(got_v[n, sl, j], want_v, rtol=0, atol=0)
    assert storage.nbytes() >= 8 * layout.row_bytes_per_page


@pytest.mark.parametrize("pair", ["int8+int4", "fp8+int4", "int4", "int8+fp8"])
def test_the_emulator_reads_what_the_server_stores(pair: str) -> None:
    """emulator.compressed.TierSelection (hi_fmt: bench.offline_loss's "h+l@rho") over the
    layout's tiers gives every kept token exactly the value the server's rows read back."""
    storage, pages, starts, k, v, scores = _sealed(pair, 4)
    layout = storage.layout
    selection = TierSelection(head_tiers(layout.tiers, layout.groups), layout.low, layout.high)
    sinks = sink_mask(starts, P)
    em_k, em_v = selection.sealed_kv(0, scores, sinks, k, v)  # [3, P, H, D]
    keep = selection.keep(0, scores, sinks)
    for g, (heads, t) in enumerate(zip(layout.groups[0], layout.tiers[0], strict=True)):
        got_k, got_v = storage.page_kv(0, g, pages)
        hi, lo = select_tiers(scores[:, list(heads)], t.hi, t.total, sinks)  # [3, H_p, *]
        order = torch.cat([hi, lo], -1)
        for j, h in enumerate(heads):
            assert keep[:, h].sum(-1).tolist() == [t.total] * 3
            rows = order[:, j]  # [3, k] token offsets in slot order
            want_k = torch.gather(em_k[:, :, h], 1, rows[..., None].expand(-1, -1, D))
            want_v = torch.gather(em_v[:, :, h], 1, rows[..., None].expand(-1, -1, D))
            assert torch.equal(got_k[:, :, j], want_k) and torch.equal(got_v[:, :, j], want_v)


# ---- the torch reference --------------------------------------------------------------------


class _Brute(tra._Request):
    """test_ragged_attention's request driver, whose expected attention reads every sealed
    page's kept tokens as a brute force quantizes them: per head, the best `hi` tokens by the
    scores the sealer used (recorded), the next `lo` ones, each set quantized on its own."""

    def __init__(self, storage, gen) -> None:
        super().__init__(storage, gen)
        # (layer, page) -> the scores [H, P] and sinks [P] its selection had
        self.seals: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        write = storage.write_sealed

        def recording(layer, pages, k_tok, v_tok, selection):
            for n, page in enumerate(pages.tolist()):
                self.seals[layer, page] = (selection.scores[n].clone(), selection.sinks[n].clone())
            return write(layer, pages, k_tok, v_tok, selection)

        storage.write_sealed = recording

    def _dense(self, layer: int, q: torch.Tensor, plan) -> torch.Tensor:
        seq_len, tail = self.k.shape[1], plan.tail_start
        fmt = tier_precision(self.storage.layout.precision_name)
        out = torch.empty_like(q)
        for hq in range(q.shape[1]):
            h = hq // tra.GQA
            keys, vals = [], []
            for page_idx in range(tail // tra.P):
                page = int(self.req_to_token[0, page_idx * tra.P]) // tra.P
                scores, sinks = self.seals[layer, page]
                g, t = next((g, t) for g, (hs, t) in enumerate(zip(
                    self.storage.layout.groups[layer], self.storage.layout.tiers[layer], strict=True)) if h in hs)
                ranked = _ranked(scores[h], sinks)
                span = slice(page_idx * tra.P, (page_idx + 1) * tra.P)
                for idx, f in ((sorted(ranked[: t.hi]), fmt.high), (sorted(ranked[t.hi: t.total]), fmt.low)):
                    if idx:
                        qk, qv = _roundtrip(f, self.k[layer, span, h][idx], self.v[layer, span, h][idx])
                        keys.append(qk)
                        vals.append(qv)
            keys = torch.cat([*keys, self.k[layer, tail:, h]])
            vals = torch.cat([*vals, self.v[layer, tail:, h]])
            n_sealed = keys.shape[0] - (seq_len - tail)
            logits = q[:, hq] @ keys.T / math.sqrt(tra.D)
            q_pos = torch.arange(plan.prefix, seq_len)
            k_pos = torch.cat([torch.full((n_sealed,), -1), torch.arange(tail, seq_len)])
            logits.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            out[:, hq] = torch.softmax(logits, -1) @ vals
        return out


@pytest.mark.parametrize("pair", ["int8+int4", "fp8+int2"])
@pytest.mark.parametrize("window", [0, 1])
def test_reference_attention_over_dequantized_tiers(pair: str, window: int) -> None:
    rng = random.Random(window)
    budgets = [[rng.choice([0.25, 0.375, 0.5, 1.0]) for _ in range(tra.H_KV)] for _ in range(tra.LAYERS)]
    profile = BudgetProfile(model=None, budgets=budgets, groups=tra.GROUPS_2, source={"kind": "uniform"})
    storage = make_storage(profile, tra.P, tra.D, 64, 8, precision=pair)
    assert storage.layout.high is not None
    req = _Brute(storage, torch.Generator().manual_seed(7))
    req.forward(2 * tra.P, window, final=False)
    req.forward(2 * tra.P + 3, window, final=True)
    for _ in range(tra.P + 1):
        req.forward(1, window)
    assert len(req.seals) >= tra.LAYERS * 4
    storage.check_integrity(torch.tensor(req.free_pages))


# ---- the attention paths ---------------------------------------------------------------------


def test_paths_that_cannot_read_a_quantized_high_tier_refuse_it(caplog: pytest.LogCaptureFixture) -> None:
    """auto on a CPU picks the native kernels (they read H+L and build on the test machine:
    tests/unit/test_native_attention.py); batched reads it too (tests/unit/test_batched_torch.py);
    a path not in HIGH_TIER_READERS refuses H+L by name; the Triton kernels read it
    (tests/unit/test_kernels_*.py)."""
    storage = make_storage(uniform_profile(0.5, 2, 4, 2), 16, 16, 8, 2, precision="int8+int4")
    with caplog.at_level(logging.INFO):
        impl = make_attention_impl(storage, None, "auto")
    assert type(impl).__name__ == "NativeAttention"
    assert not [r.message for r in caplog.records if "auto uses the batched" in r.message]
    assert type(make_attention_impl(storage, None, "batched")).__name__ == "BatchedTorchAttention"
    for name in set(IMPLEMENTATIONS) - set(HIGH_TIER_READERS):
        with pytest.raises(ValueError, match=f"--ragged-attention {name} does not read a quantized high tier"):
            make_attention_impl(storage, None, name)
    assert triton_refuses(64, "int8+int4") is None and triton_refuses(64, "int4") is None
    assert "power-of-two head sizes" in triton_refuses(48, "int8+int4")
    bf16_hi = make_storage(uniform_profile(0.5, 2, 4, 2), 16, 16, 8, 2, precision="bf16+int4")
    assert type(make_attention_impl(bf16_hi, None, "auto")).__name__ != "TorchAttention"
    assert LOW_PRECISIONS["int4"] == bf16_hi.layout.low and bf16_hi.layout.high is None
