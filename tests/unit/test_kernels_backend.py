"""The backend's implementations: TritonAttention against TorchAttention on twin storages.

Same random storage twice; one forward of a mixed or a decode batch (with pages sealed and
pages staged) through each implementation; outputs, rows, staging pages and score statistics
must agree. The dispatch picks each implementation by device and by --ragged-attention.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention
from sgl_ragged.attention_backend.registry import (
    make_attention_impl,
    profile_split_ratios,
    triton_refuses,
)
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from sgl_ragged.attention_backend.triton_impl import TritonAttention
from sgl_ragged.config import RaggedConfig
from sgl_ragged.kernels.aot import layout_split_ratios
from sgl_ragged.profile import BudgetProfile
from tests.unit.kernel_cases import Spec, compare_with_reference, random_specs, random_storage

MIXED = [Spec(sealed=2, staged=5, q_len=12, seal=2), Spec(0, 0, 9, seal=1), Spec(3, 7, 1, seal=1)]
DECODE = [Spec(sealed=1, staged=7, q_len=1, seal=1), Spec(2, 3, 1), Spec(0, 2, 1)]


def _triton(storage):
    return TritonAttention(storage, layout_split_ratios(storage.layout))


@pytest.mark.parametrize("specs,decode", [(MIXED, False), (DECODE, True)])
def test_triton_attention_matches_torch_attention(kernel_device, specs, decode):
    compare_with_reference(_triton, specs, decode, 11, kernel_device)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("decode", [False, True])
def test_triton_attention_random_batches(kernel_device, seed, decode):
    """Random mixes of requests (sealing and staging), second layer, unowned rows between."""
    rng = random.Random(100 + seed)
    compare_with_reference(_triton, random_specs(rng, rng.randint(2, 4), decode), decode, seed,
                           kernel_device, layer=1, gap=1)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("specs,decode", [(MIXED, False), (DECODE, True)])
def test_triton_attention_low_tiers(kernel_device, specs, decode, precision):
    """Rows with a low tier: read (dequantized) by the attention kernels, written (quantized)
    by the sealing kernel, against the reference's torch quantizer."""
    compare_with_reference(_triton, specs, decode, 12, kernel_device, layer=1, precision=precision)


@pytest.mark.parametrize("seed", [13, 14])
@pytest.mark.parametrize("specs,decode", [(MIXED, False), (DECODE, True)])
def test_triton_attention_mixed_formats(kernel_device, specs, decode, seed):
    """A low format per head group (--ragged-precision mixed): one launch per format in each
    layer (tables.format_parts) for decode, extend and sealing, against the reference."""
    compare_with_reference(_triton, specs, decode, seed, kernel_device, layer=1,
                           precision="mixed")


def test_dispatch_by_device_and_choice():
    from sgl_ragged.attention_backend.native_impl import NativeAttention

    storage = random_storage(random.Random(0), "cpu")
    assert type(make_attention_impl(storage, None)) is NativeAttention  # built (no skip)
    assert type(make_attention_impl(storage, None, "native")) is NativeAttention
    assert isinstance(make_attention_impl(storage, None, "batched"), BatchedTorchAttention)
    assert type(make_attention_impl(storage, None, "reference")) is TorchAttention
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_attention_impl(storage, None, "triton")


def test_attention_flag_from_env():
    env = {"RAGGED_PROFILE": "uniform:0.3"}
    assert RaggedConfig.from_env(env).attention == "auto"
    assert RaggedConfig.from_env({**env, "RAGGED_ATTENTION": "reference"}).attention == "reference"
    with pytest.raises(ValueError, match="--ragged-attention 'fast' is unknown.*batched"):
        RaggedConfig.from_env({**env, "RAGGED_ATTENTION": "fast"})


def test_cpu_auto_falls_back_to_batched_without_the_native_build(monkeypatch, caplog):
    """auto: batched torch with one log line naming the compiler log; native: a refusal
    saying how to build."""
    from sgl_ragged import native

    failed = native.NativeUnavailableError("the native kernels failed to build (compiler log: "
                                           "/x/build.log)")
    monkeypatch.setattr(native, "_load", lambda: failed)
    storage = random_storage(random.Random(0), "cpu")
    with caplog.at_level("WARNING"):
        assert type(make_attention_impl(storage, None)) is BatchedTorchAttention
    assert [r.message for r in caplog.records if "/x/build.log" in r.message]
    with pytest.raises(ValueError, match="python -m sgl_ragged.native build"):
        make_attention_impl(storage, None, "native")


def test_cpu_auto_serves_other_dtypes_batched():
    storage = random_storage(random.Random(0), "cpu", dtype=torch.float16)
    assert type(make_attention_impl(storage, None)) is BatchedTorchAttention
    with pytest.raises(ValueError, match="native runs float32 and bfloat16 caches"):
        make_attention_impl(storage, None, "native")


def test_dynamic_mode_runs_on_the_reference():
    storage = random_storage(random.Random(0), "cpu")
    storage.row_keep = []  # what RaggedStorage sets up for profile dynamic:<rho>
    assert type(make_attention_impl(storage, None)) is TorchAttention
    for choice in ("batched", "native"):
        with pytest.raises(ValueError, match="dynamic reference mode"):
            make_attention_impl(storage, None, choice)


def test_split_ratios_fall_back_to_the_layout():
    storage = random_storage(random.Random(2), "cpu")
    ratios = profile_split_ratios(storage, None)
    assert len(ratios) == 1 and math.isclose(sum(ratios[0]), 1.0)
    slots = storage.layout.slots[0]
    assert ratios[0][0] / ratios[0][1] == pytest.approx(slots[0] / slots[1])


def test_split_ratios_of_low_tiers_are_equal_shares():
    """A quantized layout's split map gives every group of a layer the same share (uniform
    splits, measured faster than bytes or slots for the Triton kernel on codes), even where
    the groups' rows differ and a profile gives other ratios."""
    storage = random_storage(random.Random(10), "cpu", layers=2, precision="int4")
    layout = storage.layout
    heads = layout.groups[0][0]
    budgets = [[0.9 if h in heads else 0.1 for h in range(4)]] * 2
    profile = BudgetProfile(model=None, budgets=budgets, groups=layout.groups,
                            source={"kind": "uniform"})
    assert profile.split_ratios is None or profile.split_ratios[0][0] > 0.5
    ratios = profile_split_ratios(storage, profile)
    assert ratios == tuple((0.5, 0.5) for _ in range(2))
    tiers = layout.tiers[1]
    assert tiers[0].hi != tiers[1].hi  # the groups' rows differ
    assert profile_split_ratios(storage, None) == ratios


def test_registry_serves_every_flag_value():
    from sgl_ragged.attention_backend.registry import IMPLEMENTATIONS
    from sgl_ragged.config import ATTENTION_IMPLS

    assert set(ATTENTION_IMPLS) == {"auto", *IMPLEMENTATIONS}
    storage = random_storage(random.Random(0), "cpu")
    with pytest.raises(ValueError, match="unknown"):
        make_attention_impl(storage, None, "flash")


def test_triton_refuses_only_what_it_cannot_pack():
    assert triton_refuses(128, "bf16") is None and triton_refuses(96, "bf16") is None
    assert triton_refuses(64, "int2") is None and triton_refuses(128, "fp8") is None
    assert "power-of-two" in triton_refuses(96, "int4")
