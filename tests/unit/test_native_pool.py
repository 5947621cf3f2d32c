"""The native kernels' own thread pool (cuda_ext/pool.cpp), through its probes: every index of a
range runs exactly once whoever takes it, the workers take pieces, nested runs, exceptions,
Python threads calling at once and a forked child each work; RAGGED_NATIVE_POOL=openmp runs the
same kernels on at::parallel_for with the same results. The extension must build here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from sgl_ragged import native
from sgl_ragged.native import pool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ext():
    return native.load()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _check(trace: torch.Tensor, threads: int, nested: int = 0) -> None:
    """Every index ran once, on a thread of the pool, with all its nested indices."""
    assert (trace[:, 0] == 1).all(), trace[:, 0].tolist()
    assert ((trace[:, 1] >= 0) & (trace[:, 1] < threads)).all(), trace[:, 1].tolist()
    assert (trace[:, 2] == nested).all(), trace[:, 2].tolist()


@pytest.mark.parametrize("n, grain", [(0, 1), (1, 1), (2, 1), (7, 1), (100, 3), (1000, 1),
                                      (5, 10), (64, 64), (65, 64)])
@pytest.mark.parametrize("piece_us", [0, 100])
def test_every_index_runs_once(ext, two_threads, n, grain, piece_us):
    _check(ext.pool_trace(n, grain, piece_us, 0), ext.pool_threads())


def test_workers_take_pieces(ext, two_threads):
    """Pieces long enough for a sleeping worker to wake: some run on worker 1 (retried, since a
    loaded machine may keep the worker off a core for a whole run)."""
    for _ in range(50):
        trace = ext.pool_trace(16, 1, 500, 0)
        _check(trace, 2)
        if (trace[:, 1] == 1).any():
            return
    pytest.fail("in 50 runs of 16 pieces of 500 us the worker never took a piece")


def test_fewer_threads_than_workers(ext):
    """After torch's thread count drops, the workers started for more threads take no pieces
    (their thread_num() would index past a workspace sized for the run)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        _check(ext.pool_trace(64, 1, 200, 0), 4)
        torch.set_num_threads(2)
        for _ in range(5):
            _check(ext.pool_trace(64, 1, 200, 0), 2)
    finally:
        torch.set_num_threads(before)


def test_nested_runs_on_the_caller(ext, two_threads):
    _check(ext.pool_trace(40, 1, 50, 5), 2, nested=5)


@pytest.mark.parametrize("fail", [0, 7, 15])
def test_an_exception_reaches_the_caller(ext, two_threads, fail):
    with pytest.raises(RuntimeError, match=f"pool_fail: index {fail} failed as asked"):
        ext.pool_fail(16, fail, 200)
    _check(ext.pool_trace(16, 1, 50, 0), 2)  # the pool still serves after it


def test_python_threads_at_once(ext, two_threads):
    """The probe releases the GIL: runs from four threads at once take the pool in turn or run on
    their callers, each index once."""
    errors: list[BaseException] = []

    def calls() -> None:
        try:
            for _ in range(20):
                _check(ext.pool_trace(200, 1, 20, 2), 2, nested=2)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    workers = [threading.Thread(target=calls) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, errors[0]


CHILD = """
import os, sys, torch
from sgl_ragged import native
from sgl_ragged.native import pool
m = native.load()
torch.set_num_threads(2)
def ok():
    t = m.pool_trace(64, 1, 100, 3)
    return bool((t[:, 0] == 1).all() and (t[:, 2] == 3).all() and (t[:, 1] < 2).all())
assert ok()
if m.pool_kind() == "pool":  # (libgomp's regions never return in a child forked after them)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if ok() else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert ok()
x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
w = torch.randn(960, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
torch.save({"kind": m.pool_kind(), "y": m.linear_bf16(x, w, None)}, sys.argv[1])
"""


@pytest.mark.parametrize("pool", ["", "openmp"])
def test_forked_child_and_openmp(tmp_path, pool):
    """A forked child's pool starts afresh (its parent's workers are not there) and serves
    (OpenMP's would hang there); the same product on either pool is the same bits."""
    out = tmp_path / "y.pt"
    env = {**os.environ, "RAGGED_NATIVE_POOL": pool}
    run = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(out)
    assert got["kind"] == (pool or "pool")
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = torch.randn(960, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(got["y"], native.load().linear_bf16(x, w, None))


def test_settings_read_as_the_kernel_reads_them():
    assert pool.kind({}) == "pool" and pool.kind({"RAGGED_NATIVE_POOL": ""}) == "pool"
    assert pool.kind({"RAGGED_NATIVE_POOL": "openmp"}) == "openmp"
    assert pool.spin_us({}) == pool.SPIN_US
    source = (ROOT / "cuda_ext" / "pool.cpp").read_text()
    assert re.search(r"constexpr int64_t SPIN_US = (\d+);", source).group(1) == str(pool.SPIN_US)
    assert pool.spin_us({"RAGGED_POOL_SPIN_US": "0"}) == 0


@pytest.mark.parametrize(("name", "value", "message"), [
    ("RAGGED_NATIVE_POOL", "omp", r"RAGGED_NATIVE_POOL=omp is not a choice: set it to pool"),
    ("RAGGED_POOL_SPIN_US", "1ms", r"RAGGED_POOL_SPIN_US=1ms is not a time: set a whole number"),
    ("RAGGED_POOL_SPIN_US", "-5", r"RAGGED_POOL_SPIN_US=-5 is not a time"),
])
def test_a_bad_setting_says_what_to_set(name, value, message):
    with pytest.raises(ValueError, match=message):
        pool.validate({name: value})


def test_the_attention_splits_smaller_layers_on_the_pool():
    from sgl_ragged.attention_backend import native_impl

    assert native_impl.default_serial_pairs({}) == native_impl.SERIAL_PAIRS == 2**12
    assert (native_impl.default_serial_pairs({"RAGGED_NATIVE_POOL": "openmp"})
            == native_impl.SERIAL_PAIRS_OPENMP == 2**16)
