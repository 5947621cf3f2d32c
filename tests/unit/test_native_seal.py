"""The native row writer (cuda_ext/seal.cpp `seal_rows`, `RaggedStorage.native_rows`) against the
storage's torch writes, bit for bit, on fresh random inputs.

Both storages start as one random storage (rows, tiers and staging filled with noise) and seal
the same pages of one layer with the same selection; every row, code and parameter tensor of
both layers must then be equal (the other layer untouched). Scores include ties (values from a
set of 3), sinks, and NaN, infinities and signed zeros (torch.sort's order for them); groups of
adjacent and of interleaved KV heads; every precision, mixed formats and quantized high tiers;
sources in the rows' dtype and in another one.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from sgl_ragged import native
from sgl_ragged.mem_pool.storage import RaggedStorage
from tests.unit.kernel_cases import H_KV, P, random_storage, storage_state

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.reason()}")

PRECISIONS = ["bf16", "int8", "int4", "int2", "fp8", "mixed", "int8+int4", "fp8+int2"]


def _pair(seed: int, precision: str, dtype: torch.dtype, interleaved: bool
          ) -> tuple[RaggedStorage, RaggedStorage]:
    rng = random.Random(seed)
    order = rng.sample(range(H_KV), H_KV) if interleaved else None
    storage = random_storage(rng, "cpu", layers=2, heads_per_group=rng.choice([1, 2]), dtype=dtype,
                             precision=precision, head_order=order)
    assert storage.native_rows, "a CPU storage writes natively where the kernels are built"
    torch_rows = copy.deepcopy(storage)
    torch_rows.native_rows = False
    return storage, torch_rows


def _scores(n: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    """[n, H, P] float32: distinct, mostly tied (3 values), or tied with NaN, +-inf, +-0."""
    if kind == "distinct":
        return torch.rand(n, H_KV, P, generator=gen)
    scores = torch.randint(0, 3, (n, H_KV, P), generator=gen).float()
    if kind == "special":
        special = torch.tensor([math.nan, -math.inf, math.inf, -0.0, 0.0])
        hit = torch.rand(n, H_KV, P, generator=gen) < 0.3
        scores[hit] = special[torch.randint(0, 5, (int(hit.sum()),), generator=gen)]
    return scores


def _seal_both(pair: tuple[RaggedStorage, RaggedStorage], seed: int, src_dtype: torch.dtype,
               kind: str, n: int = 5) -> torch.Tensor:
    """Seal n random pages of layer 1 in both storages with one selection; returns the pages."""
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    D = pair[0].layout.head_dim
    k = torch.randn(n, P, H_KV, D, generator=gen).to(src_dtype)
    v = torch.randn(n, P, H_KV, D, generator=gen).to(src_dtype)
    pages = torch.tensor(rng.sample(range(1, 40), n))
    start = torch.tensor([rng.choice([0, P, 3 * P]) for _ in range(n)])  # first pages: sinks
    scores = _scores(n, gen, kind)
    for storage in pair:
        storage.write_sealed(1, pages, k, v, storage.sealer.choose(scores, start))
    return pages


def _assert_same(native_rows: RaggedStorage, torch_rows: RaggedStorage) -> None:
    for i, (got, want) in enumerate(zip(storage_state(native_rows), storage_state(torch_rows),
                                        strict=True)):
        assert torch.equal(got, want), f"tensor {i} {tuple(got.shape)} {got.dtype}: " \
            f"{int((got != want).sum())} elements differ"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["distinct", "ties", "special"])
def test_native_rows_match_torch_rows(precision, dtype, kind):
    for seed in range(3):
        pair = _pair(seed, precision, dtype, interleaved=seed == 2)
        _seal_both(pair, seed, dtype, kind)
        _assert_same(*pair)


@pytest.mark.parametrize("precision", ["bf16", "int4", "mixed", "int8+int4"])
@pytest.mark.parametrize(("dtype", "src_dtype"), [(torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float16)])
def test_native_rows_convert_like_torch(precision, dtype, src_dtype):
    """Sources in another dtype: dense rows rounded as .to() rounds, tiers quantized from the
    source's own values."""
    pair = _pair(7, precision, dtype, interleaved=True)
    _seal_both(pair, 7, src_dtype, "ties")
    _assert_same(*pair)


def test_native_rows_padding_pages_write_nothing():
    """Pages of -1 (a captured graph's padding) leave every row as it was."""
    storage, _ = _pair(3, "mixed", torch.bfloat16, interleaved=False)
    before = [t.clone() for t in storage_state(storage)]
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, P, H_KV, storage.layout.head_dim, generator=gen).bfloat16() for _ in "kv")
    selection = storage.sealer.choose(torch.rand(2, H_KV, P, generator=gen), torch.tensor([0, P]))
    storage.write_sealed(1, torch.tensor([-1, -1]), k, v, selection)
    for got, want in zip(storage_state(storage), before, strict=True):
        assert torch.equal(got, want)


def test_native_rows_refuse_bad_input():
    """A page outside the rows, or a source whose shape disagrees with the scores, is refused
    with a message naming it, before anything is written."""
    storage, _ = _pair(4, "int4", torch.float32, interleaved=False)
    before = [t.clone() for t in storage_state(storage)]
    gen = torch.Generator().manual_seed(4)
    D = storage.layout.head_dim
    k, v = torch.randn(2, P, H_KV, D, generator=gen), torch.randn(2, P, H_KV, D, generator=gen)
    selection = storage.sealer.choose(torch.rand(2, H_KV, P, generator=gen), torch.tensor([0, P]))
    with pytest.raises(RuntimeError, match=r"seal_rows: page 48 is not in \[-1, 48\)"):
        storage.write_sealed(1, torch.tensor([3, 48]), k, v, selection)
    with pytest.raises(RuntimeError, match=r"seal_rows: scores .* is not \[2, 4, 4\]"):
        storage.write_sealed(1, torch.tensor([3, 4]), k[:, : P // 2], v[:, : P // 2], selection)
    for got, want in zip(storage_state(storage), before, strict=True):
        assert torch.equal(got, want)
