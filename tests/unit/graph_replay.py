"""A CPU stand-in for a CUDA graph, to test graph-captured code without a GPU.

A CUDA graph records the kernels one run of a function launches and replays exactly those
kernels later: same addresses, grid sizes and scalars; none of the function's Python runs
again. `RecordedGraph` gives CPU code the same semantics. Capture runs the function once and
records every aten op (through a TorchDispatchMode) and every Triton launch (under
TRITON_INTERPRET=1, by wrapping the interpreter's launch); replay re-executes the recorded ops
in order on the tensors of the capture and writes each op's result into the tensor it returned
at capture. So every tensor keeps its capture-time memory, as in a graph's memory pool: the
capture's outputs hold each replay's results, and tensors that existed before the capture are
read and written in place, as a graph reads its static buffers.

So code that decides anything on the host from data (a branch, a size, a Python scalar) replays
its capture-time decision, as under CUDA, and a test that compares replayed results with an
eager reference catches it. Host reads that CUDA capture rejects outright (.item(), .tolist(),
bool(tensor), torch.tensor(list) inside the capture, data-dependent output sizes) raise
`HostReadInCapture` here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {
    torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default,
}
_HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class HostReadInCapture(RuntimeError):
    """The captured code read device data on the host or built a tensor from host data."""


@dataclass
class _Op:
    run: Callable[..., Any]
    args: tuple
    kwargs: dict
    out: Any


class RecordedGraph:
    """capture() once, then replay() any number of times (see the module docstring)."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self._launching = False

    @contextmanager
    def capture(self) -> Iterator[None]:
        if self.ops:
            raise RuntimeError("this graph is already captured")
        with self._triton_launches(), _NoHostReads(self), _Recorder(self):
            yield

    def replay(self) -> None:
        for op in self.ops:
            out = op.run(*op.args, **op.kwargs)
            for fixed, fresh in zip(_tensors(op.out), _tensors(out), strict=True):
                same_memory = fresh.data_ptr() == fixed.data_ptr() and fresh.stride() == fixed.stride()
                if not same_memory:  # a new result: into the capture's tensor, like graph memory
                    fixed.copy_(fresh)

    @contextmanager
    def _triton_launches(self) -> Iterator[None]:
        """Record each Triton launch as one op (the interpreter's own tensor ops are not)."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        graph = self

        def launch(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if graph._launching:
                return original(fn, *args, **kwargs)
            graph._launching = True
            try:
                out = original(fn, *args, **kwargs)
            finally:
                graph._launching = False
            graph.ops.append(_Op(lambda *a, **k: _launch_quietly(graph, original, fn, a, k),
                                 args, kwargs, None))
            return out

        InterpretedFunction.run = launch
        try:
            yield
        finally:
            InterpretedFunction.run = original


def _launch_quietly(graph: RecordedGraph, original: Callable, fn: Any, args: tuple,
                    kwargs: dict) -> None:
    graph._launching = True
    try:
        original(fn, *args, **kwargs)
    finally:
        graph._launching = False


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.graph._launching:  # inside the interpreter: part of the launch op
            return func(*args, **kwargs)
        if func in _DATA_DEPENDENT or (func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            raise HostReadInCapture(f"{func} inside a graph capture")
        out = func(*args, **kwargs)
        self.graph.ops.append(_Op(func, args, kwargs, out))
        return out


class _NoHostReads(TorchFunctionMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if not self.graph._launching and getattr(func, "__name__", "") in _HOST_READS:
            raise HostReadInCapture(f"Tensor.{func.__name__}() inside a graph capture")
        return func(*args, **(kwargs or {}))
