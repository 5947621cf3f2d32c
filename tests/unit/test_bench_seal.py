"""bench.seal: every step of a seal is timed for every precision and row writer (and the
indexed-heads torch writer beside them), and one seal through the bench writes the rows the
storage's own seal writes."""

from __future__ import annotations

import pytest
import torch

from bench import seal
from bench.cpu_attention import DEFAULT_PROFILE, build_case
from sgl_ragged import native
from sgl_ragged.mem_pool.sealer import SealBatch
from sgl_ragged.profile import BudgetProfile


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.reason()}")
def test_every_step_of_every_variant_is_timed():
    profile = BudgetProfile.load(DEFAULT_PROFILE)
    results = seal.measure(profile, ["bf16", "int4"], 5, warmup=0, repeats=1, index_heads=True)
    assert [(r["precision"], r["writer"], r["heads"]) for r in results] == [
        (p, w, h) for p in ("bf16", "int4")
        for w, h in (("native", "slices"), ("torch", "slices"), ("torch", "indices"))]
    for r in results:
        assert r["pages"] == 5 and r["layers"] == profile.num_layers
        assert all(r[f"{step}_s"] > 0 for step in seal.STEPS)
        assert abs(r["total_s"] - sum(r[f"{step}_s"] for step in seal.STEPS)) < 1e-9
    table = seal.markdown(results, DEFAULT_PROFILE.name)
    assert "| int4 | torch | indices |" in table and "| int4 | native | slices |" in table


def test_the_torch_writer_alone():
    """--writers torch: the one writer a machine without the native kernels has."""
    profile = BudgetProfile.load(DEFAULT_PROFILE)
    results = seal.measure(profile, ["int4"], 2, warmup=0, repeats=1, writers=("torch",))
    assert [(r["writer"], r["heads"]) for r in results] == [("torch", "slices")]
    assert "| int4 | torch | slices |" in seal.markdown(results, DEFAULT_PROFILE.name)


def test_a_timed_seal_writes_what_the_storage_seals():
    profile = BudgetProfile.load(DEFAULT_PROFILE)
    storage, _, _ = build_case(profile, 1, 1024, False, "int4")
    twin, _, _ = build_case(profile, 1, 1024, False, "int4")
    for a, b in zip(storage.stage_k + storage.stage_v, twin.stage_k + twin.stage_v, strict=True):
        b.copy_(a)
    seal.seal_steps(storage, 2)
    stages, pages, starts = torch.arange(2), torch.tensor([1, 2]), torch.tensor([0, 64])
    for layer in range(profile.num_layers):  # the storage's own seal of the same pages
        stats = twin.stats.page_stats(layer, stages, twin.stage_k[layer][stages],
                                      twin.stage_v[layer][stages], twin.scale)
        twin.seal(layer, SealBatch(stats, pages, starts, count=2))
    for layer in (0, profile.num_layers - 1):
        for a, b in zip(storage.rows_k[layer] + storage.rows_v[layer],
                        twin.rows_k[layer] + twin.rows_v[layer], strict=True):
            assert torch.equal(a[1:3], b[1:3])
        for a, b in zip(storage.low_rows[layer], twin.low_rows[layer], strict=True):
            for x, y in zip(a.tensors(), b.tensors(), strict=True):
                assert torch.equal(x[1:3], y[1:3])
