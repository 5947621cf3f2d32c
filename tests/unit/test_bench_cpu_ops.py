"""bench.cpu_ops: both forms of every op timed per row count, the step share and the table; the
two forms it times compute the same rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from bench import cpu_ops  # noqa: E402


def test_every_op_is_timed_in_both_forms_and_tabled() -> None:
    lines: list[str] = []
    results = cpu_ops.measure([1, 5], [1], warmup=0, repeats=2, progress=lines.append)
    assert lines == ["1 thread(s), 1 rows", "1 thread(s), 5 rows"]
    assert [(r["threads"], r["rows"]) for r in results] == [(1, 1), (1, 5)]
    for r in results:
        for op in cpu_ops.OPS:
            assert r[f"{op}_torch_s"] > 0 and r[f"{op}_native_s"] > 0
        share = cpu_ops.NUM_LAYERS * (2 * r["add_rms_norm_native_s"] + r["rotary_native_s"]) \
            + r["rms_norm_native_s"]
        assert r["step_native_s"] == pytest.approx(share)
    table = cpu_ops.markdown(results)
    assert table.count("\n| 1 | ") == 2 and "30 x (2 residual norms" in table


def test_both_forms_compute_the_same_rows() -> None:
    for op, (torch_form, native_form) in cpu_ops._cases(7, torch.Generator().manual_seed(1)).items():
        a, b = torch_form(), native_form()
        a = list(a) if isinstance(a, tuple) else [a]
        assert len(a) == len(b), op
        for x, y in zip(a, b, strict=True):
            assert ((x.double() - y.double()).abs() <= 2**-7 * x.double().abs()).all(), op
