"""bench.cpu_gemm: both variants timed for every layer and row count, summed per model step."""

from __future__ import annotations

from bench import cpu_gemm


def test_every_layer_and_variant_is_timed_and_summed():
    results = cpu_gemm.measure([1, 16], [1], warmup=0, repeats=1)
    assert [(r["rows"], r["layer"]) for r in results] == [
        (m, name) for m in (1, 16) for name, _, _ in cpu_gemm.LAYERS]
    assert all(r["bfloat16_s"] > 0 and r["float32_s"] > 0 for r in results)
    steps = cpu_gemm.model_steps(results)
    assert [s["rows"] for s in steps] == [1, 16]
    for step in steps:
        mine = [r for r in results if r["rows"] == step["rows"]]
        for v in cpu_gemm.VARIANTS:
            total = cpu_gemm.NUM_LAYERS * sum(r[f"{v}_s"] for r in mine)
            assert abs(step[f"{v}_s"] - total) < 1e-12
    table = cpu_gemm.markdown(results)
    assert "| 1 | 16 | gate_up_proj |" in table and "model step (30 layers)" in table


def test_both_variants_compute_the_same_rows():
    import torch

    x = torch.randn(20, 64).bfloat16()
    w = torch.randn(48, 64).bfloat16()
    a, b = (fn(x, w).double() for fn in cpu_gemm.VARIANTS.values())
    assert torch.allclose(a, b, rtol=2**-7, atol=1e-5)
