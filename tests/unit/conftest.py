"""Fixtures of the kernel tests (tests/unit/test_kernels_*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import INTERPRET


@pytest.fixture
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Where the Triton kernels run: the GPU if there is one, else the CPU under Triton's
    interpreter, with TRITON_INTERPRET=1 set only while the test runs (see tests/conftest.py)."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        yield "cpu"
    else:
        yield "cuda"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)
