"""Build and load the native CPU kernels (cuda_ext/ at the repository root).

The extension is compiled with torch.utils.cpp_extension.load into a cache directory outside the
clone, ~/.cache/sgl-ragged/native-<hash> (SGL_RAGGED_CACHE moves the root), keyed by the
sources, the compiler flags and the torch version: a checkout that changes nothing reuses it, an
edit of cuda_ext/ builds a fresh one. The compiler's output goes to build.log in that directory.
`python -m sgl_ragged.native build` builds it (scripts/env.sh runs it after installing the
checkout); `load()` returns the module, `available()` says whether it loads, `reason()` why not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

SOURCE_DIR = Path(__file__).resolve().parents[2] / "cuda_ext"
SOURCES = ("bindings.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp")
HEADERS = ("ragged_attention.h", "attention_body.inc")
CFLAGS = ("-O3", "-fopenmp")  # per-ISA flags are #pragma GCC target in isa_*.cpp
LDFLAGS = ("-fopenmp",)
NAME = "sgl_ragged_native"


class NativeUnavailableError(RuntimeError):
    """The native kernels are not built here (or failed to build)."""


def cache_dir() -> Path:
    """~/.cache/sgl-ragged/native-<hash of sources, flags, torch version>."""
    root = Path(os.environ.get("SGL_RAGGED_CACHE", Path.home() / ".cache" / "sgl-ragged"))
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join((*CFLAGS, *LDFLAGS, torch.__version__)).encode())
    return root / f"native-{digest.hexdigest()[:12]}"


def log_path() -> Path:
    return cache_dir() / "build.log"


def build(verbose: bool = False) -> ModuleType:
    """Compile (or reuse) the extension; raises NativeUnavailableError naming the log on failure."""
    missing = [n for n in (*SOURCES, *HEADERS) if not (SOURCE_DIR / n).is_file()]
    if missing:
        raise NativeUnavailableError(f"native kernel sources missing in {SOURCE_DIR}: {missing}")
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with _output_to(log_path()):
            from torch.utils import cpp_extension  # warns about CUDA on import: into the log

            module = cpp_extension.load(
                name=NAME, sources=[str(SOURCE_DIR / n) for n in SOURCES],
                extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                build_directory=str(out), verbose=True)
    except Exception as e:  # the compiler's errors are in the log
        with log_path().open("a") as log:
            log.write(f"\n{type(e).__name__}: {e}\n")
        raise NativeUnavailableError(
            f"the native kernels failed to build (compiler log: {log_path()})") from e
    if verbose:
        print(log_path().read_text())
    return module


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """stdout and stderr of this process and its children (the compiler) into `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@functools.cache
def _load() -> ModuleType | NativeUnavailableError:
    try:
        return build()
    except NativeUnavailableError as e:
        return e


def load() -> ModuleType:
    """The built extension (built on first use if needed); NativeUnavailableError if it
    cannot be built, with the compiler log's path."""
    result = _load()
    if isinstance(result, NativeUnavailableError):
        raise result
    return result


def available() -> bool:
    return not isinstance(_load(), NativeUnavailableError)


def reason() -> str | None:
    """Why the native kernels are unavailable (None when they load)."""
    result = _load()
    return str(result) if isinstance(result, NativeUnavailableError) else None
