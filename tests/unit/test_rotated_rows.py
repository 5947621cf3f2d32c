"""Rotated rows in the server (--ragged-rotation hadamard, rotation.HeadRotations): the
matrices against the emulator's Rotation per global (layer, KV head), the flag's refusals, and
RaggedAttention driven through prefill chunks and decode steps: at rows that lose nothing the
rotated and unrotated servers agree on every output and every seal (the scorers are
invariant); at int4 they equal a brute force that quantizes each tier of kept tokens in the
rotated basis; and an outlier channel costs the rotated rows less."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_ragged import native
from sgl_ragged.attention_backend.backend import RaggedAttention
from sgl_ragged.attention_backend.registry import make_attention_impl
from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.quant import dequantize, quantize
from sgl_ragged.profile import BudgetProfile, ModelShape
from sgl_ragged.rotation import HeadRotations, Rotation
from sgl_ragged.serving.runtime import build_setup
from tests.unit.kernel_cases import make_storage
from tests.unit.test_high_tier import _Brute, _ranked
from tests.unit.test_ragged_attention import GQA, H_KV, LAYERS, D, P
from tests.unit.test_ragged_attention import GROUPS_2 as GROUPS

SCALE = 1 / math.sqrt(D)


# ---- the matrices --------------------------------------------------------------------------


KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not native.available(), reason=f"native kernels: {native.reason()}"))]


@pytest.mark.parametrize("kernel", KERNELS, ids=["dense", "native"])
def test_head_rotations_are_the_emulators_per_global_layer_and_head(kernel: bool) -> None:
    rot = Rotation(D)
    rotations = HeadRotations(rot, range(3, 5), range(2, 4), native=kernel)  # a PP stage, a TP rank
    assert (rotations.kernels is not None) == kernel
    gen = torch.Generator().manual_seed(0)
    for local, layer in enumerate((3, 4)):
        for j, head in enumerate((2, 3)):
            torch.testing.assert_close(rotations.matrices[local][j], rot.matrix(layer, head))
        kv = torch.randn(5, 2, D, generator=gen)
        want = rot.apply(kv[None], layer, [2, 3])[0]
        torch.testing.assert_close(rotations.rotate(kv, local), want, atol=1e-5, rtol=1e-5)
        q = torch.randn(5, 2 * 3, D, generator=gen)  # 3 query heads per KV head
        got = rotations.rotate(q, local)
        for hq in range(6):
            torch.testing.assert_close(got[:, hq], q[:, hq] @ rot.matrix(layer, 2 + hq // 3),
                                       atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rotations.restore(got, local), q, atol=1e-5, rtol=1e-5)
        assert rotations.rotate(q.bfloat16(), local).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="a multiple of 2 heads"):
        rotations.rotate(torch.zeros(1, 3, D), 0)
    with pytest.raises(ValueError, match="a multiple of 2 heads, 16"):
        rotations.rotate(torch.zeros(1, 2, 8), 0)


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.reason()}")
@pytest.mark.parametrize("d", [4, 8, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_rotation_is_the_transform_of_the_emulator(d: int, dtype: torch.dtype) -> None:
    """hadamard_heads (one native call per tensor): rotation.py's fwht bit for bit (the same
    butterflies in float32, one rounding; rows below 8 floats on the scalar loop, 64 and 128 in
    registers, the others through memory) at head sizes whose sqrt is exact, within one rounding
    otherwise; the dense float64 product within float32's error before that rounding; strided
    token rows (a view of a fused qkv) read in place; empty batches."""
    rot = Rotation(d)
    gen = torch.Generator().manual_seed(d)
    rotations = HeadRotations(rot, [7], [1, 4], native=True)
    dense = torch.stack([rot.matrix(7, h) for h in (1, 4)]).double()
    for heads in (2, 6):
        fused = torch.randn(13, heads + 4, d, generator=gen).to(dtype)
        x = fused[:, :heads]  # rows strided by the fused width, heads contiguous
        got = rotations.rotate(x, 0)
        assert got.dtype == dtype and got.is_contiguous()
        groups = x.view(13, 2, heads // 2, d)
        want = rot.apply(groups.transpose(1, 2), 7, [1, 4]).transpose(1, 2).reshape(13, heads, d)
        back_want = rot.invert(groups.transpose(1, 2), 7, [1, 4]).transpose(1, 2).reshape(13, heads, d)
        back = rotations.restore(x, 0)
        exact = math.sqrt(d).is_integer()
        tol = {} if exact else {"atol": 0, "rtol": 2 * torch.finfo(dtype).eps}
        torch.testing.assert_close(got, want, **({"atol": 0, "rtol": 0} if exact else tol))
        torch.testing.assert_close(back, back_want, **({"atol": 0, "rtol": 0} if exact else tol))
        per_head = dense.repeat_interleave(heads // 2, 0)
        exact_rot = torch.einsum("thd,hde->the", x.double(), per_head)
        torch.testing.assert_close(got.double(), exact_rot, atol=4 * torch.finfo(dtype).eps * d ** 0.5,
                                   rtol=2 * torch.finfo(dtype).eps)
        torch.testing.assert_close(rotations.restore(got, 0).double(), x.double(),
                                   atol=8 * torch.finfo(dtype).eps * d ** 0.5, rtol=4 * torch.finfo(dtype).eps)
    assert rotations.rotate(torch.zeros(0, 2, d, dtype=dtype), 0).shape == (0, 2, d)


def test_the_flag_refuses_what_it_cannot_rotate() -> None:
    assert RaggedConfig(profile="uniform:0.5", precision="int4", rotation="hadamard").rotated
    assert not RaggedConfig(profile="uniform:0.5", precision="int4").rotated
    with pytest.raises(ValueError, match="'givens' is unknown; choose one of"):
        RaggedConfig(profile="uniform:0.5", precision="int4", rotation="givens")
    with pytest.raises(ValueError, match="bf16 keeps none; pass a low precision"):
        RaggedConfig(profile="uniform:0.5", precision="bf16", rotation="hadamard")
    with pytest.raises(ValueError, match="expected_attention scores them by per-channel"):
        RaggedConfig(profile="uniform:0.5", precision="int4", rotation="hadamard",
                     scorer="expected_attention")
    env = RaggedConfig.from_env({"RAGGED_PROFILE": "uniform:0.5", "RAGGED_PRECISION": "int4",
                                 "RAGGED_ROTATION": "Hadamard"})
    assert env.rotation == "hadamard"
    config = RaggedConfig(profile="uniform:0.5", precision="int4", rotation="hadamard")
    kwargs = dict(page_size=16, dtype_bytes=2, max_running_requests=2, attention_scale=0.125)
    with pytest.raises(ValueError, match="power-of-two head_dim; this model's is 80"):
        build_setup(config, ModelShape("LlamaForCausalLM", 4, 4, 80), tp_size=1, tp_rank=0, **kwargs)
    setup = build_setup(config, ModelShape("LlamaForCausalLM", 4, 4, 64), tp_size=2, tp_rank=1,
                        layers=(1, 3), **kwargs)  # a pipeline stage's layers, a TP rank's heads
    rotations = setup.rotations("cpu")
    assert rotations.layers == (1, 2) and rotations.kv_heads == (2, 3)
    assert build_setup(RaggedConfig(profile="uniform:0.5", precision="int4"),
                       ModelShape("LlamaForCausalLM", 4, 4, 80), tp_size=1, tp_rank=0,
                       **kwargs).rotations("cpu") is None
    storage = make_storage(BudgetProfile(model=None, budgets=[[0.5] * H_KV] * LAYERS,
                                         groups=GROUPS, source={"kind": "uniform"}),
                           P, D, 16, 4, precision="int4")
    impl = make_attention_impl(storage, None, "reference")
    table = torch.zeros(1, 64, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs the rows' rotations"):
        RaggedAttention(storage, impl, config, table)
    with pytest.raises(ValueError, match="--ragged-rotation is none"):
        RaggedAttention(storage, impl, RaggedConfig(profile="uniform:0.5", precision="int4"), table,
                        rotation=HeadRotations(Rotation(D), range(LAYERS), range(H_KV)))
    with pytest.raises(ValueError, match="cover 3 layers, the storage 2"):
        RaggedAttention(storage, impl, config, table,
                        rotation=HeadRotations(Rotation(D), range(3), range(H_KV)))


# ---- RaggedAttention on rotated rows -------------------------------------------------------


class _Server(_Brute):
    """One request through RaggedAttention (float32 storage), its full history kept, every
    seal's scores recorded (test_high_tier's driver)."""

    def __init__(self, budgets, precision: str, rotation: str, impl: str, window: int,
                 history_gen: torch.Generator) -> None:
        profile = BudgetProfile(model=None, budgets=budgets, groups=GROUPS, source={"kind": "uniform"})
        super().__init__(make_storage(profile, P, D, 64, 8, precision=precision), history_gen)
        config = RaggedConfig(profile="uniform:0.5", precision=precision, rotation=rotation,
                              window_pages=window, obs_window=4)
        self.rot = Rotation(D)
        rotations = (HeadRotations(self.rot, range(LAYERS), range(H_KV))
                     if config.rotated else None)
        self.attention = RaggedAttention(self.storage, make_attention_impl(self.storage, None, impl),
                                         config, self.req_to_token, rotation=rotations)

    def forward(self, n_new: int, final: bool = True, outlier: float = 0.0):
        """One forward of n_new tokens -> (per layer (q, output), the plan). outlier: channel
        3 of every value is scaled up by it (an outlier channel)."""
        prefix = self.k.shape[1]
        seq_len = prefix + n_new
        self.allocate(prefix, seq_len)
        self.attention.begin_forward([0], [prefix], [seq_len], [final])
        plan = self.attention.forward_metadata.plan.requests[0]
        k_new = torch.randn(LAYERS, n_new, H_KV, D, generator=self.gen)
        v_new = torch.randn(LAYERS, n_new, H_KV, D, generator=self.gen)
        if outlier:
            v_new[..., 3] *= outlier
        self.k, self.v = torch.cat([self.k, k_new], 1), torch.cat([self.v, v_new], 1)
        outs = []
        for layer in range(LAYERS):
            q = torch.randn(n_new, H_KV * GQA, D, generator=self.gen)
            outs.append((q, self.attention.forward(layer, q, k_new[layer], v_new[layer], SCALE,
                                                   n_new == 1)))
        return outs, plan

    def brute(self, layer: int, q: torch.Tensor, plan) -> torch.Tensor:
        """Softmax attention in the rotated basis over every sealed page's kept tokens, the
        best `hi` by the recorded scores as they are, the next `lo` quantized on their own, and
        the whole tail; rotated back."""
        seq_len, tail = self.k.shape[1], plan.tail_start
        layout = self.storage.layout
        out = torch.empty_like(q)
        for hq in range(q.shape[1]):
            h = hq // GQA
            r = self.rot.matrix(layer, h)
            k_rot, v_rot = self.k[layer, :, h] @ r, self.v[layer, :, h] @ r
            keys, vals = [], []
            t = next(t for hs, t in zip(layout.groups[layer], layout.tiers[layer], strict=True) if h in hs)
            for page_idx in range(tail // P):
                page = int(self.req_to_token[0, page_idx * P]) // P
                scores, sinks = self.seals[layer, page]
                ranked = _ranked(scores[h], sinks)
                span = slice(page_idx * P, (page_idx + 1) * P)
                hi, lo = sorted(ranked[: t.hi]), sorted(ranked[t.hi : t.total])
                keys.append(k_rot[span][hi])
                vals.append(v_rot[span][hi])
                if lo:
                    qk, qv = dequantize(layout.low, quantize(layout.low, k_rot[span][lo][None, :, None],
                                                             v_rot[span][lo][None, :, None]), torch.float32)
                    keys.append(qk[0, :, 0])
                    vals.append(qv[0, :, 0])
            keys, vals = torch.cat([*keys, k_rot[tail:]]), torch.cat([*vals, v_rot[tail:]])
            n_sealed = keys.shape[0] - (seq_len - tail)
            logits = (q[:, hq] @ r) @ keys.T * SCALE
            q_pos = torch.arange(plan.prefix, seq_len)
            k_pos = torch.cat([torch.full((n_sealed,), -1), torch.arange(tail, seq_len)])
            logits.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            out[:, hq] = (torch.softmax(logits, -1) @ vals) @ r.T
        return out

    def exact(self, layer: int, q: torch.Tensor, plan) -> torch.Tensor:
        """The same attention over unquantized kept tokens in the original basis."""
        seq_len, tail = self.k.shape[1], plan.tail_start
        layout = self.storage.layout
        out = torch.empty_like(q)
        for hq in range(q.shape[1]):
            h = hq // GQA
            t = next(t for hs, t in zip(layout.groups[layer], layout.tiers[layer], strict=True) if h in hs)
            kept = [page_idx * P + i for page_idx in range(tail // P)
                    for i in sorted(_ranked(*self._seal(layer, page_idx, h))[: t.total])]
            idx = torch.tensor(kept + list(range(tail, seq_len)), dtype=torch.long)
            logits = q[:, hq] @ self.k[layer, idx, h].T * SCALE
            k_pos = torch.cat([torch.full((len(kept),), -1), torch.arange(tail, seq_len)])
            logits.masked_fill_(k_pos[None, :] > torch.arange(plan.prefix, seq_len)[:, None],
                                float("-inf"))
            out[:, hq] = torch.softmax(logits, -1) @ self.v[layer, idx, h]
        return out

    def _seal(self, layer: int, page_idx: int, h: int):
        scores, sinks = self.seals[layer, int(self.req_to_token[0, page_idx * P]) // P]
        return scores[h], sinks


def _drive(server: _Server, outlier: float = 0.0):
    """Two prefill chunks, then decode steps across page boundaries; yields each forward."""
    yield server.forward(2 * P, final=False, outlier=outlier)
    yield server.forward(2 * P + 3, final=True, outlier=outlier)
    for _ in range(P + 2):
        yield server.forward(1, outlier=outlier)


@pytest.mark.parametrize("impl", ["reference", "batched", "native"])
def test_rows_that_lose_nothing_attend_alike_rotated_and_not(impl: str) -> None:
    """int4 at ratio 1.0 keeps every token in the model dtype (no low tier): rotating changes
    nothing but rounding, and every seal ranks the tokens alike."""
    budgets = [[1.0] * H_KV] * LAYERS
    plain = _Server(budgets, "int4", "none", impl, 1, torch.Generator().manual_seed(1))
    rotated = _Server(budgets, "int4", "hadamard", impl, 1, torch.Generator().manual_seed(1))
    assert all(t.lo == 0 for layer in plain.storage.layout.tiers for t in layer)
    for (want, _), (got, _) in zip(_drive(plain), _drive(rotated), strict=True):
        for (_, a), (_, b) in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5)
    assert plain.seals.keys() == rotated.seals.keys() and len(plain.seals) >= 2 * LAYERS
    for key, (scores, sinks) in plain.seals.items():
        torch.testing.assert_close(rotated.seals[key][0], scores, atol=1e-5, rtol=1e-4)
        assert torch.equal(rotated.seals[key][1], sinks)
    rotated.storage.check_integrity(torch.tensor(rotated.free_pages))


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("precision", ["int4", "int2", "fp8"])
@pytest.mark.parametrize("window", [0, 1])
def test_rotated_tiers_are_the_brute_force(impl: str, precision: str, window: int) -> None:
    """Budgets 0.25-0.75 (hi and lo slots): each output against the rotated-basis brute force
    over the tokens the server's own seals ranked (their scores read attention over quantized
    rows, so they differ from an unrotated server's by its rounding)."""
    rng = random.Random(window + len(precision))
    budgets = [[rng.choice([0.25, 0.375, 0.5, 0.75]) for _ in range(H_KV)] for _ in range(LAYERS)]
    server = _Server(budgets, precision, "hadamard", impl, window, torch.Generator().manual_seed(5))
    assert any(t.lo for layer in server.storage.layout.tiers for t in layer)
    for outs, plan in _drive(server):
        for layer, (q, out) in enumerate(outs):
            torch.testing.assert_close(out, server.brute(layer, q, plan), atol=1e-4, rtol=1e-4)
    assert len(server.seals) >= 4 * LAYERS
    server.storage.check_integrity(torch.tensor(server.free_pages))


def test_an_outlier_channel_costs_rotated_int4_rows_less() -> None:
    """Channel 3 of the values 12x the rest: values are quantized per token, so the outlier
    sets every token's scale; rotated, it is spread over all channels. The rotated int4 rows'
    outputs are closer to attention over the unquantized kept tokens (error summed over every
    forward; 0.66 of the unrotated rows' at this seed). Keys are quantized per channel, where
    an outlier channel costs nothing to begin with (the rotation gains nothing there on random
    data; the models' keys: docs/results.md, "Rotated low tiers, offline")."""
    budgets = [[0.5] * H_KV] * LAYERS
    errors = {}
    for rotation in ("none", "hadamard"):
        server = _Server(budgets, "int4", rotation, "reference", 0, torch.Generator().manual_seed(9))
        total = 0.0
        for outs, plan in _drive(server, outlier=12.0):
            for layer, (q, out) in enumerate(outs):
                total += float((out - server.exact(layer, q, plan)).norm())
        errors[rotation] = total
    assert errors["hadamard"] < 0.8 * errors["none"], errors
