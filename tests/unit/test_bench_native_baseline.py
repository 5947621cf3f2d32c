"""bench.native_baseline and bench.cpu_attention --baseline: a baseline build of the native
kernels must not share the current build's name (both would run the same code)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import cpu_attention, native_baseline
from sgl_ragged.native import HEADERS, NAME, SOURCES


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
