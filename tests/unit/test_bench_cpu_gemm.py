"""bench.cpu_gemm: every variant's model step and lm_head timed for every row count; the table."""

from __future__ import annotations

import torch

from bench import cpu_gemm


def test_every_variant_is_timed_per_rows_and_tabled():
    lines = []
    results = cpu_gemm.measure([1, 3], [1], warmup=0, repeats=2, num_layers=2, vocab=64,
                               progress=lines.append)
    assert lines == ["1 thread(s), 1 rows", "1 thread(s), 3 rows"]
    assert [(r["threads"], r["rows"], r["layers"]) for r in results] == [(1, 1, 2), (1, 3, 2)]
    for r in results:
        for v in cpu_gemm.VARIANTS:
            assert r[f"{v}_step_s"] > 0 and r[f"{v}_lm_head_s"] > 0
    table = cpu_gemm.markdown(results)
    assert table.count("\n| 1 | ") == 2 and "model step (2 layers" in table
    assert "RAGGED_CPU_GEMM=auto routes here" in table


def test_the_variants_compute_the_same_rows():
    x = torch.randn(20, 64).bfloat16()
    w = torch.randn(48, 64).bfloat16()
    ref = torch.nn.functional.linear(x.double(), w.double())
    for fn in cpu_gemm.VARIANTS.values():
        out = fn(x, w).double()
        assert ((out - ref).abs() <= 2**-7 * ref.abs() + 1e-5).all()


def test_split_thresholds_are_variants_of_the_same_rounds():
    """--dot-serial-macs: the native kernel at each threshold in the same rounds, the same bits
    as the process's own, which each call restores; their own table with ratios to the first."""
    results = cpu_gemm.measure([2], [2], warmup=0, repeats=2, num_layers=2, vocab=64,
                               dot_serial_macs=[2**22, 0])
    assert all(results[0][f"native@{m}_step_s"] > 0 for m in (2**22, 0))
    table = cpu_gemm.markdown(results)
    assert "| native@4194304 step ms | native@0 step ms | native@4194304 / native@0 |" in table
    assert table.split("ratios against native@4194304")[1].count("\n| 2 | 2 | ") == 1
    module = cpu_gemm.cpu_gemm.kernel()
    own = module.linear_dot_serial_macs()
    x, w = torch.randn(4, 576).bfloat16(), torch.randn(960, 576).bfloat16()
    assert torch.equal(cpu_gemm.at_threshold(0)(x, w), module.linear_bf16(x, w, None))
    assert module.linear_dot_serial_macs() == own


def test_which_variant_runs_first_swaps_every_round():
    from bench import cpu_sweep

    assert [cpu_sweep.round_order("abc", r) for r in range(3)] == [
        list("abc"), list("cba"), list("abc")]
    assert cpu_sweep.round_order(iter({"x": 1, "y": 2}.items()), 1) == [("y", 2), ("x", 1)]


def test_a_baseline_build_is_a_variant_of_the_same_rounds():
    """--baseline: another build's kernel (here this build's own module stands in for it) timed
    in the same rounds at the process's split threshold, in a table of its own."""
    from sgl_ragged import native

    results = cpu_gemm.measure([3], [1], warmup=0, repeats=2, num_layers=2, vocab=64,
                               baseline=native.load())
    assert results[0]["baseline_step_s"] > 0 and results[0]["baseline_lm_head_s"] > 0
    table = cpu_gemm.markdown(results)
    assert "| threads | rows | baseline step ms | native step ms | baseline / native |" in table
    assert table.split("Another build of the kernel")[1].count("\n| 1 | 3 | ") == 1


def test_a_baseline_of_another_summation_order_is_compared_within_a_step():
    """Two builds may sum the same products in another order (another form of the kernel): their
    bfloat16 outputs then differ by at most a bfloat16 step, which the check allows; a product
    further off (another rounding, a wrong kernel) is refused."""
    a = torch.tensor([1.0, -3.0, 0.0, 1e-9]).bfloat16()
    assert cpu_gemm.same_rounding(a, a)
    assert cpu_gemm.same_rounding(a, (a.double() * (1 + 2**-8)).bfloat16())
    assert not cpu_gemm.same_rounding(a, (a.double() * (1 + 2**-5)).bfloat16())
    assert not cpu_gemm.same_rounding(a, torch.tensor([1.0, -3.0, 1e-3, 1e-9]).bfloat16())
