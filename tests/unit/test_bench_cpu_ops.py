"""bench.cpu_ops: every form of every op timed per row count (a --baseline build a third), the
step share and the tables; the forms it times compute the same rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from bench import cpu_ops  # noqa: E402
from sgl_ragged import native  # noqa: E402


def test_every_op_is_timed_in_each_form_and_tabled() -> None:
    lines: list[str] = []
    results = cpu_ops.measure([1, 5], [1], warmup=0, repeats=2, progress=lines.append)
    assert lines == ["1 thread(s), 1 rows", "1 thread(s), 5 rows"]
    assert [(r["threads"], r["rows"]) for r in results] == [(1, 1), (1, 5)]
    for r in results:
        for op in cpu_ops.OPS:
            assert r[f"{op}_torch_s"] > 0 and r[f"{op}_native_s"] > 0
            assert f"{op}_baseline_s" not in r
        share = cpu_ops.NUM_LAYERS * (2 * r["add_rms_norm_native_s"] + r["rotary_native_s"]) \
            + r["rms_norm_native_s"]
        assert r["step_native_s"] == pytest.approx(share)
    table = cpu_ops.markdown(results)
    assert table.count("\n| 1 | ") == 2 and "30 x (2 residual norms" in table
    assert "--baseline" not in table


def test_a_baseline_build_is_a_third_form() -> None:
    """--baseline's module runs every native call in the same rounds (here the current build
    stands in for it) and gets its own table."""
    results = cpu_ops.measure([3], [1], warmup=0, repeats=1, baseline=native.load())
    for op in cpu_ops.OPS:
        assert results[0][f"{op}_baseline_s"] > 0
    assert results[0]["step_baseline_s"] > 0
    table = cpu_ops.markdown(results)
    assert "on the --baseline build" in table and table.count("\n| 1 | 3 | ") == 2


def test_every_form_computes_the_same_rows() -> None:
    """The native call as SGLang's torch form (the rotation: as the dense product, within
    float32's error before bfloat16's rounding), and the baseline form as the native one."""
    cases = cpu_ops._cases(7, torch.Generator().manual_seed(1), baseline=native.load())
    for op, forms in cases.items():
        outs = {form: fn() for form, fn in forms.items()}
        outs = {form: [o] if isinstance(o, torch.Tensor) else list(o) for form, o in outs.items()}
        assert len(outs["torch"]) == len(outs["native"]) == len(outs["baseline"]), op
        for x, y, z in zip(outs["torch"], outs["native"], outs["baseline"], strict=True):
            assert torch.equal(y, z), op
            if op == "hadamard":
                torch.testing.assert_close(y.float(), x.float(), atol=2**-6, rtol=2**-7)
            else:
                assert ((x.double() - y.double()).abs() <= 2**-7 * x.double().abs()).all(), op
