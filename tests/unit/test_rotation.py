"""Randomized Hadamard rotations (rotation.py) against dense brute forces, and rotated row tiers
in the offline emulator (TierSelection.rotation, the "int4r" precisions of the benches)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.accuracy_configs import config_bytes, precision_configs, split_rotated
from sgl_ragged.emulator.compressed import CompressedLoss, TierSelection
from sgl_ragged.emulator.runner import CaptureRunner, LayerQKV
from sgl_ragged.mem_pool.quant import dequantize, quantize
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.rotation import Rotation, fwht, hadamard
from sgl_ragged.scoring import make_scorer
from tests.unit.test_compressed_tiers import assert_per_query_softmax, brute_sealed
from tests.unit.test_sources import TINY

INT4 = LOW_PRECISIONS["int4"]


def _walsh(d: int) -> torch.Tensor:
    """[D, D] normalized Walsh-Hadamard matrix from its closed form: (-1)^popcount(i & j) / sqrt(D)."""
    return torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(d)] for i in range(d)]) / math.sqrt(d)


def _dense(rot: Rotation, layer: int, head: int) -> torch.Tensor:
    """R = diag(signs) W written out entry by entry."""
    s, w = rot.signs(layer, [head])[0], _walsh(rot.head_dim)
    return torch.tensor([[float(s[i] * w[i, j]) for j in range(rot.head_dim)] for i in range(rot.head_dim)])


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_fwht_is_the_dense_walsh_hadamard(d: int) -> None:
    w = _walsh(d)
    torch.testing.assert_close(hadamard(d), w)
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(fwht(x), x @ w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fwht(fwht(x)), x, atol=1e-5, rtol=1e-5)  # symmetric and orthogonal


@pytest.mark.parametrize("d", [8, 64, 128])
def test_rotation_is_orthogonal_inverse_and_the_dense_matrix(d: int) -> None:
    rot = Rotation(d, seed=3)
    heads = [0, 2, 1]
    dense = torch.stack([_dense(rot, 4, h) for h in heads])  # [H', D, D]
    for h, r in zip(heads, dense, strict=True):
        torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
        torch.testing.assert_close(rot.matrix(4, h), r)
    x = torch.randn(2, 7, len(heads), d, generator=torch.Generator().manual_seed(1))
    y = rot.apply(x, 4, heads)
    torch.testing.assert_close(y, torch.einsum("ntha,hab->nthb", x, dense), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rot.invert(y, 4, heads), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    assert y.dtype == x.dtype
    yb = rot.apply(x.bfloat16(), 4, heads)
    assert yb.dtype == torch.bfloat16


def test_rotation_is_deterministic_from_the_seed() -> None:
    a, b = Rotation(64, seed=5), Rotation(64, seed=5)
    assert torch.equal(a.signs(3, [0, 1, 2]), b.signs(3, [0, 1, 2]))
    assert set(a.signs(3, [0]).unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(a.signs(3, [2, 0])[1], a.signs(3, [0])[0])  # per head, not per call
    others = [Rotation(64, seed=6).signs(3, [0]), a.signs(4, [0]), a.signs(3, [1])]
    assert all(not torch.equal(a.signs(3, [0]), o) for o in others)
    assert torch.equal(Rotation(64).signs(0, [0]), Rotation(64, seed=0).signs(0, [0]))


def test_rotation_errors_are_clear() -> None:
    for d in (0, 48, 96):
        with pytest.raises(ValueError, match="power-of-two head_dim"):
            Rotation(d)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        fwht(torch.zeros(3, 12))
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 2 heads, 8\]"):
        Rotation(8).apply(torch.zeros(4, 3, 8), 0, [0, 1])
    with pytest.raises(ValueError, match="non-negative"):
        Rotation(8).signs(-1, [0])


def test_rotated_attention_is_attention_on_the_rotated_back_values() -> None:
    """The equivalence TierSelection's docstring states: a server attending with q R over the
    rotated tier as stored (dequantized codes of K R, V R) and rotating its output back computes
    what the emulator computes with q over those values rotated back."""
    gen = torch.Generator().manual_seed(2)
    rot = Rotation(16, seed=1)
    q = torch.randn(5, 1, 16, generator=gen)  # [queries, H, D]
    k, v = (torch.randn(1, 9, 1, 16, generator=gen) * 3 for _ in range(2))  # [N, T, H, D]
    stored_k, stored_v = dequantize(INT4, quantize(INT4, rot.apply(k, 0, [0]), rot.apply(v, 0, [0])),
                                    torch.float32)
    server = torch.softmax(rot.apply(q, 0, [0])[:, 0] @ stored_k[0, :, 0].T, -1) @ stored_v[0, :, 0]
    server = rot.invert(server[:, None], 0, [0])[:, 0]
    back_k, back_v = rot.invert(stored_k, 0, [0]), rot.invert(stored_v, 0, [0])
    emulated = torch.softmax(q[:, 0] @ back_k[0, :, 0].T, -1) @ back_v[0, :, 0]
    torch.testing.assert_close(server, emulated, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(back_k, k, atol=1e-3)  # and the tier was quantized


def test_rotation_flattens_an_outlier_channel() -> None:
    """Why rotate: values are quantized per token, so one large channel costs the others their
    precision; rotated, the int4 round trip of such values is several times closer."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 64, 2, 64, generator=gen)
    v = torch.randn(4, 64, 2, 64, generator=gen)
    v[..., 5] *= 40
    rot = Rotation(64)
    _, plain = dequantize(INT4, quantize(INT4, k, v), torch.float32)
    rk, rv = rot.apply(k, 0, [0, 1]), rot.apply(v, 0, [0, 1])
    _, rotated = dequantize(INT4, quantize(INT4, rk, rv), torch.float32)
    rotated = rot.invert(rotated, 0, [0, 1])
    assert (rotated - v).norm() * 3 < (plain - v).norm()


def test_sealed_kv_rotated_is_the_unrotated_tiers_of_rotated_kv() -> None:
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(3, 16, 3, 8, generator=gen) for _ in range(2))  # [N, P, H, D]
    scores, sinks = torch.rand(3, 3, 16, generator=gen), torch.zeros(3, 16, dtype=torch.bool)
    tiers = [[RowTiers(2, 9), RowTiers(0, 16), RowTiers(5, 3)]] * 2
    rot = Rotation(8, seed=9)
    heads = [0, 1, 2]
    for hi_fmt in (None, LOW_PRECISIONS["int8"]):
        got_k, got_v = TierSelection(tiers, INT4, hi_fmt, rot).sealed_kv(1, scores, sinks, k, v)
        want = TierSelection(tiers, INT4, hi_fmt).sealed_kv(1, scores, sinks, rot.apply(k, 1, heads),
                                                            rot.apply(v, 1, heads))
        torch.testing.assert_close(got_k, rot.invert(want[0], 1, heads), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, rot.invert(want[1], 1, heads), atol=1e-5, rtol=1e-5)
        plain = TierSelection(tiers, INT4, hi_fmt).sealed_kv(1, scores, sinks, k, v)
        assert not torch.allclose(got_k, plain[0])
    # Without a quantized hi tier, the hi tokens and dropped entries are untouched (not rotated).
    keep = TierSelection(tiers, INT4).keep(1, scores, sinks)  # [N, H, P]
    got_k, _ = TierSelection(tiers, INT4, None, rot).sealed_kv(1, scores, sinks, k, v)
    assert torch.equal(got_k[:, :, 1][~keep[:, 1]], k[:, :, 1][~keep[:, 1]])
    hi = [[RowTiers(16, 0)] * 3] * 2
    assert torch.equal(TierSelection(hi, INT4, None, rot).sealed_kv(0, scores, sinks, k, v)[0], k)


def test_rotated_tier_attention_is_the_servers(tiny_llama: Path) -> None:
    """The emulator's attention with rotated tiers, rotated by R, equals per-query softmax in the
    rotated space (q R over the rows a rotating server would hold: own chunk K R, V R exact,
    sealed tiers quantized rotated), i.e. a server that rotates its output back."""
    runner = CaptureRunner(str(tiny_llama))
    loss = CompressedLoss(runner, make_scorer("snapkv"), TINY)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(h, 64, 8, generator=gen) for h in (4, 2, 2))  # [H, T, D]
    tiers = [[RowTiers(2, 7), RowTiers(0, 16)], [RowTiers(16, 0), RowTiers(1, 3)]]
    rot = Rotation(8, seed=2)
    out = loss._attention(TierSelection(tiers, INT4, rotation=rot))(0, q, k, v)  # [H_q, T, D]

    def rotate(x: torch.Tensor, heads: list[int]) -> torch.Tensor:  # [H, T, D] per head
        return rot.apply(x.transpose(0, 1), 0, heads).transpose(0, 1)

    qr, kr, vr = rotate(q, [0, 0, 1, 1]), rotate(k, [0, 1]), rotate(v, [0, 1])
    layer = LayerQKV(qr.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1))
    sealed = brute_sealed(layer, tiers[0], INT4, runner.scale)
    assert_per_query_softmax(rotate(out, [0, 0, 1, 1]), qr, kr, vr, sealed, runner.scale)


# ---- the benches' grammar --------------------------------------------------------------------


def test_rotated_precisions_parse_and_cost_the_same_bytes() -> None:
    assert split_rotated("int4r") == ("int4", True)
    assert split_rotated("int4") == ("int4", False)
    assert split_rotated("int8+int4r") == ("int8+int4", True)
    assert split_rotated("fp8r") == ("fp8", True)
    for bad, match in (("bf16r", "no quantized tier"), ("int4rr", "one 'r' suffix"),
                       ("int8r+int4", "one 'r' suffix"), ("int9r", "not a low precision"),
                       ("int8+int9r", "expected <hi>")):
        with pytest.raises(ValueError, match=match):
            split_rotated(bad)
    configs = precision_configs([0.3, 0.15], ["int4r", "int8+int4r"], "snapkv", 64)
    assert [(c.name, c.kind, c.precision) for c in configs] == [
        ("int4r-all@0.28125", "tiers-all", "int4r"), ("int4r@0.15", "tiers", "int4r"),
        ("int4r@0.3", "tiers", "int4r"), ("int8+int4r@0.15", "tiers-mixed", "int8+int4r"),
        ("int8+int4r@0.3", "tiers-mixed", "int8+int4r")]
    plain = {c.name: c for c in precision_configs([0.3, 0.15], ["int4", "int8+int4"], "snapkv", 64)}

    class Shape:  # SmolLM2-135M's KV shape
        num_layers, num_kv_heads, head_dim = 30, 3, 64

    for c in configs:
        twin = plain[c.name.replace("r@", "@").replace("r-all", "-all")]
        assert config_bytes(c, Shape(), 64) == config_bytes(twin, Shape(), 64)


def test_rotated_configurations_are_served_rotated(tmp_path: Path) -> None:
    """bench.accuracy serves a rotated configuration as its base precision with
    --ragged-rotation hadamard ("int4r@0.3": int4 rows stored rotated); "mixedr" is the
    per-head profiles' "mixed" rotated, with the same file."""
    from bench.accuracy_configs import plan_configs

    int4r = precision_configs([0.3], ["int4r"], "snapkv", 64)[-1]
    assert int4r.server_args()[-4:] == ["--ragged-precision", "int4", "--ragged-rotation", "hadamard"]
    int4 = precision_configs([0.3], ["int4"], "snapkv", 64)[-1]
    assert int4.server_args()[-2:] == ["--ragged-rotation", "none"]  # never a profile's auto
    pair = precision_configs([0.3], ["int8+int4r"], "snapkv", 64)[-1]
    assert pair.server_args()[-4:] == ["--ragged-precision", "int8+int4", "--ragged-rotation", "hadamard"]
    assert split_rotated("mixedr") == ("mixed", True)
    (tmp_path / "mixed-uniform-rho0.3.json").write_text("{}")
    configs, missing = plan_configs([0.3, 0.2], ["snapkv"], tmp_path, 64, ["mixed", "mixedr"])
    per_head = [c for c in configs if c.kind == "tiers-per-head"]
    assert [(c.name, c.precision, Path(c.profile).name) for c in per_head] == [
        ("mixed@0.3", "mixed", "mixed-uniform-rho0.3.json"),
        ("mixedr@0.3", "mixedr", "mixed-uniform-rho0.3.json")]
    assert per_head[1].server_args()[-4:] == ["--ragged-precision", "mixed", "--ragged-rotation", "hadamard"]
    assert missing.count(str(tmp_path / "mixed-uniform-rho0.2.json")) == 1
