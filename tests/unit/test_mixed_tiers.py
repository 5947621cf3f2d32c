"""Row tiers with a quantized high tier (tiers.compose_mixed, TierSelection.hi_fmt, the
"hi+lo@rho" configurations of bench.offline_loss) against brute forces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.accuracy_configs import config_bytes, mixed_formats, mixed_tiers, precision_configs
from sgl_ragged.emulator.compressed import CompressedLoss, TierSelection
from sgl_ragged.emulator.runner import CaptureRunner, LayerQKV
from sgl_ragged.mem_pool.tiers import RowTiers, compose, compose_mixed, mixed_tier_bytes
from sgl_ragged.precision import LOW_PRECISIONS, LowPrecision
from sgl_ragged.scoring import SINK_TOKENS, make_scorer
from tests.unit.test_compressed_tiers import assert_per_query_softmax, brute_sealed
from tests.unit.test_sources import TINY

INT8, INT4, INT2 = (LOW_PRECISIONS[p] for p in ("int8", "int4", "int2"))


def _tier_cost(fmt: LowPrecision, n: int, d: int) -> int:
    """Bytes of one head's tier of n tokens, written out: codes of K and V, a scale and a zero
    (fp16) per key channel, a scale and a zero per value token."""
    return 0 if n == 0 else 2 * n * d * fmt.bits // 8 + d * 2 * 2 + n * 2 * 2


def _brute_mixed(slots: int, page: int, d: int, hi_fmt: LowPrecision, lo_fmt: LowPrecision) -> RowTiers | None:
    """Among all (hi, lo) within the budget: the most tokens, then the most hi ones."""
    budget = 2 * slots * d * 2
    fits = [(hi + lo, hi) for hi in range(page + 1) for lo in range(page + 1 - hi)
            if _tier_cost(hi_fmt, hi, d) + _tier_cost(lo_fmt, lo, d) <= budget]
    total, hi = max(fits)
    return RowTiers(hi, total - hi) if total >= SINK_TOKENS else None


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("pair", [(INT8, INT4), (INT8, INT2), (INT4, INT2), (INT4, INT4)])
def test_compose_mixed_is_the_brute_force(d: int, pair: tuple[LowPrecision, LowPrecision]) -> None:
    hi_fmt, lo_fmt = pair
    for page in (16, 64):
        for slots in range(SINK_TOKENS, page + 1):
            want = _brute_mixed(slots, page, d, hi_fmt, lo_fmt)
            if want is None:
                with pytest.raises(ValueError, match="bf16 high tier"):
                    compose_mixed(slots, page, d, 2, hi_fmt, lo_fmt, SINK_TOKENS)
                continue
            got = compose_mixed(slots, page, d, 2, hi_fmt, lo_fmt, SINK_TOKENS)
            assert got == want, (slots, page, d)
            cost = _tier_cost(hi_fmt, got.hi, d) + _tier_cost(lo_fmt, got.lo, d)
            assert mixed_tier_bytes(got, hi_fmt, lo_fmt, 1, d) == cost <= 2 * slots * d * 2
            assert mixed_tier_bytes(got, hi_fmt, lo_fmt, 3, d) == 3 * cost


def test_compose_mixed_at_half_the_bytes_and_its_checks() -> None:
    # SmolLM2 (d 64, page 64) at 32 slots: every token kept, int8 where int4 leaves room.
    got = compose_mixed(32, 64, 64, 2, INT8, INT4, SINK_TOKENS)
    assert got.total == 64 and got.hi > 0
    assert compose(32, 64, 64, 2, INT4, SINK_TOKENS).total == 64  # the bf16-hi rule, for contrast
    with pytest.raises(ValueError, match="cheaper"):
        compose_mixed(32, 64, 64, 2, INT4, INT8, SINK_TOKENS)
    with pytest.raises(ValueError, match="cheaper"):
        compose_mixed(32, 64, 64, 2, LOW_PRECISIONS["fp8"], INT8, SINK_TOKENS)


def test_mixed_configs_parse_and_count_bytes() -> None:
    assert mixed_formats("int8+int4") == (INT8, INT4)
    for bad in ("int8", "int8+bf16", "int8+int4+int2", "int9+int4"):
        with pytest.raises(ValueError, match="expected <hi>"):
            mixed_formats(bad)
    configs = precision_configs([0.5, 0.3, 1.0], ["int8+int4"], "snapkv", 64)
    assert [(c.name, c.kind, c.profile, c.precision) for c in configs] == [
        ("int8+int4@0.3", "tiers-mixed", "uniform:0.3", "int8+int4"),
        ("int8+int4@0.5", "tiers-mixed", "uniform:0.5", "int8+int4")]

    class Shape:  # SmolLM2-135M's KV shape
        num_layers, num_kv_heads, head_dim = 30, 3, 64

    config = configs[1]
    tiers, retention = mixed_tiers(config, Shape(), 64)
    t = compose_mixed(32, 64, 64, 2, INT8, INT4, SINK_TOKENS)
    assert all(x == t for layer in tiers for x in layer)
    want = (_tier_cost(INT8, t.hi, 64) + _tier_cost(INT4, t.lo, 64)) / (2 * 64 * 64 * 2)
    assert retention == pytest.approx(want) and config_bytes(config, Shape(), 64) == pytest.approx(want)
    assert 0.45 < retention <= 0.5


def test_bench_accuracy_refuses_pairs_no_server_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.accuracy as acc

    monkeypatch.setattr("sys.argv", ["bench.accuracy", "--precision", "int4+int2", "--model", "/nonexistent"])
    with pytest.raises(SystemExit, match=r"--precision int4\+int2: --ragged-precision 'int4\+int2' is unknown"):
        acc.main()


# ---- the emulator ----------------------------------------------------------------------------



@pytest.mark.parametrize("pair", [("int8", "int4"), ("int4", "int2")])
def test_mixed_tier_attention_matches_per_query_softmax(tiny_llama: Path, pair: tuple[str, str]) -> None:
    runner = CaptureRunner(str(tiny_llama))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(h, 64, 8, generator=gen) for h in (4, 2, 2))
    tiers = [[RowTiers(3, 7), RowTiers(16, 0)], [RowTiers(0, 16), RowTiers(1, 3)]]
    hi_fmt, lo_fmt = (LOW_PRECISIONS[x] for x in pair)
    out = loss._attention(TierSelection(tiers, lo_fmt, hi_fmt))(0, q, k, v)
    layer = LayerQKV(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    sealed = brute_sealed(layer, tiers[0], lo_fmt, runner.scale, hi_fmt=hi_fmt)
    assert not torch.equal(sealed[1], layer.k.transpose(0, 1))  # the hi tier was quantized too
    assert_per_query_softmax(out, q, k, v, sealed, runner.scale)
