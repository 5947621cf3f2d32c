"""The project venv's startup import hook: one meta-path finder, installed by a ``.pth`` file
(:data:`PTH_LINE`, written by scripts/env.sh) in every interpreter of the venv, that handles a
few module names (:data:`STANDINS` through ``sgl_kernel_cpu.find_spec``, :data:`GPU_ONLY`
through :func:`gpu_only_spec`) and leaves every other import alone.

- ``sgl_kernel`` and SGLang's CuTe DSL dual GEMM module (:data:`DUAL_GEMM`): the real
  module, or a stand-in where it cannot load (compat/sgl_kernel_cpu.py). SGLang's spawned
  processes import ``sgl_kernel`` while unpickling their target, before plugins load, so only a
  startup hook is early enough.
- Packages a CPU process imports for nothing (:data:`GPU_ONLY`): where torch is imported and
  sees no GPU, they import as if not installed (``ModuleNotFoundError``, which SGLang's optional
  imports catch), unless ``RAGGED_GPU_ONLY_IMPORTS=import``. SGLang 0.5.23 imports FlashInfer in
  a try block from its quantization modules (2.4 s on a 2 GHz Zen 1, CUTLASS's DSL with it), and
  tvm_ffi imports ml_dtypes for its numpy dtype names (1.3 s, its extension's initialisation);
  SGLang itself calls FlashInfer available only on CUDA (``is_flashinfer_available``), and
  tvm_ffi runs without ml_dtypes. A server's launcher imports in 19.0 s instead of 23.2 there
  (docs/results.md, "FlashInfer and ml_dtypes not imported on a CPU"). CUTLASS's Python DSL
  (``cutlass``, nvidia-cutlass-dsl) builds GPU kernels only; a CPU scheduler's model registry
  imported it for Inkling's CuTe flash attention, whose two architectures now leave the CPU
  registry (SGLang logs the import error it ignores), and SGLang's CuTe DSL dual GEMM module
  gets its stand-in, as where CUTLASS is not installed.

The module imports nothing heavy: the finder runs at every interpreter start and sees every
import, and a process that never imports torch must not pay for it here.
"""

from __future__ import annotations

import importlib.abc
import sys
import sysconfig
import types
from importlib.machinery import ModuleSpec
from pathlib import Path

from sgl_ragged.envs import env_choice

PTH_NAME = "sgl_ragged_sgl_kernel_hook.pth"
DUAL_GEMM = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
"""SGLang's CuTe DSL dual GEMM module, which needs CUTLASS's DSL (compat.dual_gemm)."""
STANDINS = ("sgl_kernel", DUAL_GEMM)
GPU_ONLY = ("flashinfer", "ml_dtypes", "cutlass")
"""Top-level packages a CPU process of the venv does not import (see the module docstring)."""
ENV = "RAGGED_GPU_ONLY_IMPORTS"
CHOICES = {"skip": "import GPU_ONLY packages as if not installed where torch sees no GPU",
           "import": "import them as usual"}
_HOOK = "SglRaggedKernelHook"
# One line, as .pth files require. site.py exec()s it inside a function, so the lambda may
# use builtins only; the any(...) guard keeps it idempotent (venvs with a lib64 -> lib
# symlink process their .pth files twice). STANDINS go to sgl_kernel_cpu.find_spec (every
# version of this package has it). GPU_ONLY names reach the hook only once torch is imported
# (before, they could not be skipped anyway), and go to this module's gpu_only_spec, which
# imports nothing: torch's own import looks `cutlass` up (importlib.util.find_spec) while
# sgl_kernel_cpu, which imports torch, may be half-initialized. A checkout older than this
# module then fails GPU_ONLY imports as missing, which their importers' try blocks take as absent.
PTH_LINE = (
    "import sys; "
    f"any(type(f).__name__ == '{_HOOK}' for f in sys.meta_path) or sys.meta_path.insert(0, "
    f"type('{_HOOK}', (), {{'find_spec': staticmethod(lambda name, path=None, target=None: "
    "__import__('sgl_ragged.compat.sgl_kernel_cpu', fromlist=['find_spec']).find_spec(name, path) "
    f"if name in {STANDINS!r} else "
    "__import__('sgl_ragged.compat.import_hook', fromlist=['gpu_only_spec']).gpu_only_spec(name) "
    f"if name in {GPU_ONLY!r} and 'torch' in __import__('sys').modules "
    "else None)})())"
)


class _NotOnThisMachine(importlib.abc.Loader):
    """Fails the import of a GPU_ONLY package as a missing one would, saying how to allow it."""

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        raise ModuleNotFoundError(
            f"{name} is not imported on this machine: torch sees no GPU, and sgl-ragged's "
            f"import hook (sgl_ragged/compat/import_hook.py) skips it; set {ENV}=import to "
            f"import it", name=name)


def skips_gpu_only() -> bool:
    """Whether GPU_ONLY packages import as missing now: torch is imported and sees no GPU, and
    RAGGED_GPU_ONLY_IMPORTS is not `import`."""
    if env_choice(ENV, CHOICES, default="skip") == "import":
        return False
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    is_available = getattr(cuda, "is_available", None)
    return is_available is not None and not is_available()


def gpu_only_spec(name: str) -> ModuleSpec | None:
    """A spec that fails `name`'s import where it is a GPU_ONLY package to skip now, else None
    (the other finders import it as usual)."""
    if name in GPU_ONLY and skips_gpu_only():
        return ModuleSpec(name, _NotOnThisMachine())
    return None


def write_import_hook(site_packages: Path | None = None) -> Path:
    """Write :data:`PTH_LINE` as ``PTH_NAME`` into ``site_packages`` (default: this venv's)."""
    target = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text(PTH_LINE + "\n")
    return target
