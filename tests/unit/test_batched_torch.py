"""Batched torch attention (the CPU default) against the per-request torch reference.

Random batches of requests with sealed rows, staged tokens and new tokens (decode batches,
prefill chunks and mixed batches, with unowned rows between requests), on twin storages:
outputs, rows, staging pages, statistics and counters must agree.
"""

from __future__ import annotations

import random

import pytest

from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention
from tests.unit.kernel_cases import P, Spec, compare_with_reference, random_specs


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("decode", [False, True])
def test_batched_matches_reference(seed, decode):
    rng = random.Random(seed)
    specs = random_specs(rng, rng.randint(1, 6), decode)
    compare_with_reference(BatchedTorchAttention, specs, decode, seed, "cpu", layer=seed % 2,
                           gap=seed % 3)


@pytest.mark.parametrize("specs,decode", [
    ([Spec(sealed=0, staged=0, q_len=1)], True),  # a lone first token
    ([Spec(sealed=3, staged=0, q_len=1), Spec(0, 2 * P - 1, 1, seal=1)], True),
    ([Spec(sealed=0, staged=0, q_len=3 * P, seal=3), Spec(5, P, 1)], False),  # mixed batch
    ([Spec(sealed=2, staged=3, q_len=2 * P + 1, seal=1)], False),
])
def test_batched_edge_cases(specs, decode):
    compare_with_reference(BatchedTorchAttention, specs, decode, 7, "cpu", layer=1, gap=2)
