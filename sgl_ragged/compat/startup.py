"""Interpreter-startup hook that makes `import sgl_kernel` fall back to the CPU stand-in.

SGLang's spawned scheduler imports `sgl_kernel` while unpickling its entry point, before any
plugin runs, so the fallback must already be armed at interpreter startup. scripts/env.sh
installs `sgl_ragged_startup.pth` (one line: `import sgl_ragged.compat.startup`) into the venv;
`python -m sgl_ragged.compat.startup install` does the same for any environment.

Arming only adds a finder for the name `sgl_kernel`: nothing is imported until SGLang asks for
it, and then the real package wins whenever it loads (GPU machines are untouched).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import site
import sys
import types
from pathlib import Path

PTH_NAME = "sgl_ragged_startup.pth"


class _StandInLoader(importlib.abc.Loader):
    """Hands out whatever install_if_needed() left in sys.modules (real or stand-in)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class SglKernelFinder(importlib.abc.MetaPathFinder):
    """On the first `import sgl_kernel`: try the real one, else install the stand-in."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != "sgl_kernel":
            return None
        sys.meta_path.remove(self)
        from sgl_ragged.compat.sgl_kernel_cpu import install_if_needed

        install_if_needed()
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


def arm() -> None:
    """Put the finder first on sys.meta_path (idempotent)."""
    if "sgl_kernel" in sys.modules or any(isinstance(f, SglKernelFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SglKernelFinder())


def install_pth(site_dir: str | None = None) -> Path:
    """Write the .pth file that arms the finder at every interpreter start."""
    target = Path(site_dir or site.getsitepackages()[0]) / PTH_NAME
    target.write_text("import sgl_ragged.compat.startup\n")
    return target


arm()

if __name__ == "__main__" and sys.argv[1:] == ["install"]:
    print(install_pth())
