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
