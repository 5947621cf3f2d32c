"""Build and load the native CPU kernels (cuda_ext/ at the repository root).

The extension is compiled with torch.utils.cpp_extension.load into a cache directory outside the
clone, ~/.cache/sgl-ragged/native-<hash> (RAGGED_CACHE moves the root), keyed by the
sources, the compiler flags and the torch version: a checkout that changes nothing reuses it, an
edit of cuda_ext/ builds a fresh one. The compiler's output goes to build.log in that directory.
`python -m sgl_ragged.native build` builds it (scripts/env.sh runs it after installing the
checkout); `load()` returns the module, `available()` says whether it loads, `reason()` why not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SOURCE_DIR = Path(__file__).resolve().parents[2] / "cuda_ext"
SOURCES = ("bindings.cpp", "isa_amx.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp",
           "quantize.cpp", "tails.cpp", "linear.cpp")
HEADERS = ("ragged_attention.h", "attention_body.inc", "quantize.h", "tails.h", "checks.h",
           "linear.h")
CFLAGS = ("-O3", "-fopenmp")  # per-ISA flags are #pragma GCC target in isa_*.cpp
LDFLAGS = ("-fopenmp",)
NAME = "sgl_ragged_native"


STAMP = "complete"  # written in the cache directory after a successful build


class NativeUnavailableError(RuntimeError):
    """The native kernels are not built here (or failed to build)."""


def cache_dir() -> Path:
    """~/.cache/sgl-ragged/native-<hash of sources, flags, torch version>; torch's version is
    read from its version.py, not imported (env.sh's up-to-date check stays fast)."""
    root = Path(os.environ.get("RAGGED_CACHE", Path.home() / ".cache" / "sgl-ragged"))
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join((*CFLAGS, *LDFLAGS)).encode())
    digest.update(_torch_version_file().read_bytes())
    return root / f"native-{digest.hexdigest()[:12]}"


def _torch_version_file() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise NativeUnavailableError("torch is not installed")
    return Path(spec.origin).parent / "version.py"


def is_built() -> bool:
    """A successful build of the current sources is in the cache (no torch import)."""
    return (cache_dir() / STAMP).is_file()


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
            f"the native kernels (cuda_ext/) failed to build (compiler log: {log_path()})") from e
    (out / STAMP).write_text(module.__file__ + "\n")
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


def _load_built() -> ModuleType:
    """The cached build's shared object, imported directly (no compiler, no ninja)."""
    import importlib.machinery

    import torch  # noqa: F401  (the extension links against libtorch)

    path = (cache_dir() / STAMP).read_text().strip()
    loader = importlib.machinery.ExtensionFileLoader(NAME, path)
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def _load() -> ModuleType | NativeUnavailableError:
    try:
        return _load_built() if is_built() else build()
    except NativeUnavailableError as e:
        return e
    except (OSError, ImportError) as e:  # a stale or broken cached build: rebuild it
        try:
            return build()
        except NativeUnavailableError as again:
            return NativeUnavailableError(f"{again} (loading the cached build: {e})")


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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from Linux's /proc/cpuinfo (empty elsewhere)."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return frozenset()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_amx() -> bool:
    """The CPU advertises AMX bfloat16 tiles (Linux's /proc/cpuinfo flags; False elsewhere):
    where torch's CPU matrix products (oneDNN, cpublas) multiply bfloat16 on them."""
    return "amx_bf16" in cpu_flags()
