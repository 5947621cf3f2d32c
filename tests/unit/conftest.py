"""Shared fixtures of the unit tests: the kernel tests' device (tests/unit/test_kernels_*.py),
a seeded generator, a tiny random-weight Llama checkpoint, Llama-3.1-8B's shape (no weights)
and the default model's checkpoint (no server)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sgl_ragged.testing.tiny_model import save_llama_shape, save_tiny_llama
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


@pytest.fixture(scope="session")
def model_path() -> str:
    """The default model's checkpoint (its tokenizer and config.json; no server)."""
    from sgl_ragged.models.smollm2 import ensure_smollm2

    return str(os.environ.get("RAGGED_MODEL") or ensure_smollm2())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads, head_dim 16, byte-level tokenizer),
    saved once per session; tests read it and never write into it."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def llama_8b_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json (bfloat16) and the byte-level tokenizer of Llama-3.1-8B's shape, without
    weights: what the GPU scripts' checkpoint gives a server's budget and a workload's counts."""
    path = tmp_path_factory.mktemp("llama-8b-shape")
    save_llama_shape(path)
    return path
