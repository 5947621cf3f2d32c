"""The backend's implementations: TritonAttention against TorchAttention on twin storages.

Same random storage twice; one forward of a mixed or a decode batch (with pages sealed and
pages staged) through each implementation; outputs, rows, staging pages and score statistics
must agree. The CPU dispatch must stay the torch reference.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_ragged.attention_backend.impl import (
    TorchAttention,
    make_attention_impl,
    profile_split_ratios,
)
from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata
from sgl_ragged.attention_backend.triton_impl import TritonAttention
from sgl_ragged.kernels.aot import layout_split_ratios
from tests.unit.kernel_cases import (
    D,
    Spec,
    assert_same_state,
    random_plans,
    random_qkv,
    random_specs,
    random_storage,
)

MIXED = [Spec(sealed=2, staged=5, q_len=12, seal=2), Spec(0, 0, 9, seal=1), Spec(3, 7, 1, seal=1)]
DECODE = [Spec(sealed=1, staged=7, q_len=1, seal=1), Spec(2, 3, 1), Spec(0, 2, 1)]


def _compare(specs: list[Spec], decode: bool, seed: int, device: str, layer: int = 0,
             gap: int = 0) -> None:
    """One forward through TritonAttention and TorchAttention on twin storages: outputs,
    rows, staging pages, statistics and counters agree."""
    kernel_store, ref_store = (random_storage(random.Random(seed), device, layers=2, num_stages=64)
                               for _ in range(2))
    plans = random_plans(kernel_store, specs, random.Random(seed + 1), gap=gap)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), device)
    ratios = layout_split_ratios(kernel_store.layout.groups, kernel_store.layout.slots)
    outs = []
    for impl in TritonAttention(kernel_store, ratios), TorchAttention(ref_store):
        meta = RaggedForwardMetadata(requests=plans, pages_to_seal=torch.empty(0, dtype=torch.long))
        impl.prepare(meta)
        outs.append(impl.forward(layer, meta, q, k, v, 1 / math.sqrt(D), decode))
    rows = torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in plans])
    torch.testing.assert_close(outs[0][rows], outs[1][rows], atol=2e-5, rtol=1e-4)
    assert_same_state(kernel_store, ref_store)


@pytest.mark.parametrize("specs,decode", [(MIXED, False), (DECODE, True)])
def test_triton_attention_matches_torch_attention(kernel_device, specs, decode):
    _compare(specs, decode, 11, kernel_device)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("decode", [False, True])
def test_triton_attention_random_batches(kernel_device, seed, decode):
    """Random mixes of requests (sealing and staging), second layer, unowned rows between."""
    rng = random.Random(100 + seed)
    _compare(random_specs(rng, rng.randint(2, 4), decode), decode, seed, kernel_device,
             layer=1, gap=1)


def test_cpu_dispatch_is_the_torch_reference():
    storage = random_storage(random.Random(0), "cpu")
    assert isinstance(make_attention_impl(storage, None), TorchAttention)


def test_split_ratios_fall_back_to_the_layout():
    storage = random_storage(random.Random(2), "cpu")
    ratios = profile_split_ratios(storage, None)
    assert len(ratios) == 1 and math.isclose(sum(ratios[0]), 1.0)
    slots = storage.layout.slots[0]
    assert ratios[0][0] / ratios[0][1] == pytest.approx(slots[0] / slots[1])
