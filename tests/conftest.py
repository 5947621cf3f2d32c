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

# The test suite's CPU servers fork their scheduler and detokenizer (compat/cpu_start.py): half
# a server start's CPU time, and the suite starts some 65 servers. Users' servers spawn them
# unless they ask (the default is SGLang's); tests/e2e/test_engine.py's in-process Engine spawns.
os.environ.setdefault("RAGGED_CPU_START_METHOD", "fork")
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


# ---- Shards: scripts/test.sh runs the suite as four pytest processes side by side ----
# Most of an end-to-end module's time is a server's start (about 40 s of single-threaded imports
# per server) and small forwards, and most of the unit tests' is Triton's interpreter, in
# Python: on a 2-core machine four shards keep both cores busy to the end (one process: over
# 90 minutes on a CPU without AVX512-BF16). A session-scoped server (ragged_server,
# oracle_pair) starts once per process, so the modules that share one stay in one shard, and
# within an end-to-end shard they run last: the servers alive at once (each SGLang CPU server
# is 3-4 GB in three processes) stay few.
SHARD_ENV = "RAGGED_TEST_SHARD"
SHARDS = ("unit-a", "unit-b", "e2e-a", "e2e-b")
UNIT_B_MODULES = ("test_high_tier.py", "test_kernels_aot.py", "test_kernels_attention.py",
                  "test_kernels_backend.py", "test_kernels_compile.py", "test_kernels_seal.py",
                  "test_mixed_tiers.py", "test_bench_triton_baseline.py")
"""tests/unit modules of shard unit-b (the Triton kernels under the interpreter, and their sm_90
builds); the others are unit-a, the decode-graph replays under the interpreter among them
(with them unit-b was the longest shard by far, session 20)."""
E2E_B_MODULES = ("test_equivalence.py", "test_precision.py",  # oracle_pair
                 "test_native_attention.py", "test_tensor_parallel.py",
                 "test_pipeline_parallel.py", "test_embeddings.py", "test_lora.py",
                 "test_classifiers.py",
                 "test_vision_compressed.py", "test_history_holds.py")
"""tests/e2e modules of shard e2e-b (about half of the end-to-end server time); the others,
the shared ragged_server's modules among them, are e2e-a (test_architectures.py too since
session 42, test_calibrated_profile.py since session 44: with them e2e-b ran 32 min against
e2e-a's 24)."""
SESSION_SERVERS = ("ragged_server", "oracle_pair")  # tests/e2e/conftest.py's (test_shards.py)


def shard_of(path: Path) -> str:
    """The shard a test file belongs to."""
    if path.parent.name == "e2e":
        return "e2e-b" if path.name in E2E_B_MODULES else "e2e-a"
    return "unit-b" if path.name in UNIT_B_MODULES else "unit-a"


def _uses_session_server(item: pytest.Item) -> bool:
    return any(name in SESSION_SERVERS for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get(SHARD_ENV, "")
    if not shard:
        return
    if shard not in SHARDS:
        raise pytest.UsageError(f"{SHARD_ENV}={shard} is not a shard: use one of "
                                f"{', '.join(SHARDS)}, or unset it for the whole suite")
    keep, drop = [], []
    for item in items:
        (keep if shard_of(item.path) == shard else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Modules with a session-scoped server last (stable: module order kept otherwise).
    shared = {item.path for item in keep if _uses_session_server(item)}
    items[:] = sorted(keep, key=lambda item: item.path in shared)
