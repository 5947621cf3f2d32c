"""bench.native_baseline and bench.cpu_attention --baseline: a baseline build of the native
kernels must not share the current build's name (both would run the same code); and
bench.cpu_attention --cached-rows."""

from __future__ import annotations

import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from bench import cpu_attention, native_baseline
from sgl_ragged.native import HEADERS, NAME, SOURCES
from sgl_ragged.profile import BudgetProfile


def test_sources_of_a_revision_are_exported(tmp_path):
    native_baseline.export_sources("HEAD", tmp_path)
    for name in (*SOURCES, *HEADERS):
        want = subprocess.run(["git", "show", f"HEAD:cuda_ext/{name}"], cwd=native_baseline.REPO,
                              check=True, capture_output=True).stdout
        assert (tmp_path / name).read_bytes() == want


def test_a_copy_of_the_current_build_is_refused(tmp_path):
    copy = tmp_path / f"{NAME}.so"
    copy.write_bytes(b"")
    with pytest.raises(SystemExit, match="bench.native_baseline"):
        cpu_attention.load_baseline(copy)


def test_the_baseline_is_built_under_its_own_name_and_namespace(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs)
        return type("Module", (), {"__file__": str(tmp_path / "build" / f"{kwargs['name']}.so")})

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    so = native_baseline.build("HEAD", tmp_path)
    (call,) = calls
    assert call["name"] == native_baseline.NAME != NAME and so.name == f"{native_baseline.NAME}.so"
    assert f"-Dragged={native_baseline.NAME}" in call["extra_cflags"]
    assert sorted(Path(x).name for x in call["sources"]) == sorted(SOURCES)


def test_cached_rows_are_the_same_batch_on_each_request_s_first_page():
    """--cached-rows: the same plans (tails, positions, page counts) with every sealed page the
    request's first, timed beside the native kernels and shown as the step's memory share."""
    profile = BudgetProfile.load(cpu_attention.DEFAULT_PROFILE)
    _, plans, _ = cpu_attention.build_case(profile, 2, 256, True)
    for plan, hot in zip(plans, cpu_attention.cached_plans(plans), strict=True):
        assert hot.sealed_pages.tolist() == [int(plan.sealed_pages[0])] * 4  # 256 tokens
        for f in fields(plan):
            if f.name != "sealed_pages":
                a, b = getattr(plan, f.name), getattr(hot, f.name)
                assert a is b, f.name
    results = cpu_attention.measure_native(profile, 2, 256, True, ["bf16"], 0, 1, batched=False,
                                           cached=True)
    assert results[0]["cached_s"] > 0
    assert "| cached rows ms | memory share |" in cpu_attention.markdown_native(results, "p.json")
