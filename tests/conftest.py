"""Session setup shared by unit and e2e tests.

Triton decides at decoration time whether a kernel is compiled or interpreted, and its own
standard library (tl.sum, tl.max, ...) is decorated when `triton.language` is first imported.
Without a GPU the kernel tests run under Triton's interpreter, so TRITON_INTERPRET=1 must be
set before anything imports Triton (SGLang does, from many modules) and while our kernel
modules are imported. It is removed again right after: the e2e tests start SGLang servers as
subprocesses, which must not inherit it. Kernel tests set it again only while they run
(`interpret_triton` fixture in tests/unit/kernel_cases.py).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

USER_INTERPRET = os.environ.get("TRITON_INTERPRET")  # as the user started pytest
INTERPRET = not torch.cuda.is_available() or USER_INTERPRET == "1"


def _import_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in ("triton.language", "triton.experimental.gluon", "sgl_ragged.kernels.attend",
                     "sgl_ragged.kernels.decode", "sgl_ragged.kernels.extend",
                     "sgl_ragged.kernels.seal"):
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if INTERPRET:
    _import_kernels_interpreted()


# ---- Shards: scripts/test.sh runs the suite as three pytest processes side by side ----
# Most of an end-to-end module's time is a server's start (about 40 s of single-threaded imports
# per server) and small forwards, so on a 2-core machine the unit tests and two halves of the
# end-to-end modules overlap well (one process: over 90 minutes on a CPU without AVX512-BF16).
# A module's session-scoped servers (ragged_server, oracle_pair) start once per process, so the
# modules that share one stay in one shard.
SHARD_ENV = "RAGGED_TEST_SHARD"
SHARDS = ("unit", "e2e-a", "e2e-b")
E2E_B_MODULES = ("test_equivalence.py", "test_precision.py",  # oracle_pair
                 "test_native_attention.py", "test_calibrated_profile.py",
                 "test_tensor_parallel.py")
"""tests/e2e modules of shard e2e-b (about half of the end-to-end server time); the others,
the shared ragged_server's modules among them, are e2e-a."""


def shard_of(path: Path) -> str:
    """The shard a test file belongs to."""
    if path.parent.name != "e2e":
        return "unit"
    return "e2e-b" if path.name in E2E_B_MODULES else "e2e-a"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get(SHARD_ENV, "")
    if not shard:
        return
    if shard not in SHARDS:
        raise pytest.UsageError(f"{SHARD_ENV}={shard} is not a shard: use one of "
                                f"{', '.join(SHARDS)}, or unset it for the whole suite")
    keep = [item for item in items if shard_of(item.path) == shard]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if shard_of(item.path) != shard])
        items[:] = keep
