"""Build and load the native CPU kernels (cuda_ext/ at the repository root).

The extension is compiled with torch.utils.cpp_extension.load into a cache directory outside the
clone, ~/.cache/sgl-ragged/native-<hash> (RAGGED_CACHE moves the root), keyed by the
sources, the compiler flags and the torch version: a checkout that changes nothing reuses it, an
edit of cuda_ext/ builds a fresh one. A build reads cuda_ext/ once into a snapshot (src/ of the
build), hashes that snapshot, compiles it in a temporary directory and renames the directory into
place: an edit made while the compiler runs cannot leave a cache directory whose shared object is
not its hash's sources. The compiler's output goes to build.log in that directory.
`python -m sgl_ragged.native build` builds it (scripts/env.sh runs it after installing the
checkout); `load()` returns the module, `available()` says whether it loads, `reason()` why not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from sgl_ragged.paths import default_cache_dir

SOURCE_DIR = Path(__file__).resolve().parents[2] / "cuda_ext"
SOURCES = ("bindings.cpp", "isa_amx.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp",
           "quantize.cpp", "seal.cpp", "tails.cpp", "linear.cpp", "elementwise.cpp", "pool.cpp")
HEADERS = ("ragged_attention.h", "attention_body.inc", "quantize.h", "seal.h", "tails.h", "checks.h",
           "linear.h", "elementwise.h", "elementwise_loops.inc", "pool.h")
CFLAGS = ("-O3", "-fopenmp")  # per-ISA flags are #pragma GCC target in isa_*.cpp
LDFLAGS = ("-fopenmp",)
NAME = "sgl_ragged_native"


STAMP = "complete"  # written in the cache directory after a successful build


class NativeUnavailableError(RuntimeError):
    """The native kernels are not built here (or failed to build)."""


def cache_dir() -> Path:
    """~/.cache/sgl-ragged/native-<hash of sources, flags, torch version>; torch's version is
    read from its version.py, not imported (env.sh's up-to-date check stays fast)."""
    return _dir_of(_snapshot())


def _snapshot() -> dict[str, bytes]:
    """cuda_ext/'s sources and headers, each file read once."""
    missing = [n for n in (*SOURCES, *HEADERS) if not (SOURCE_DIR / n).is_file()]
    if missing:
        raise NativeUnavailableError(f"native kernel sources missing in {SOURCE_DIR}: {missing}")
    return {name: (SOURCE_DIR / name).read_bytes() for name in (*SOURCES, *HEADERS)}


def _dir_of(snapshot: dict[str, bytes]) -> Path:
    digest = hashlib.sha256()
    for name, text in snapshot.items():
        digest.update(name.encode())
        digest.update(text)
    digest.update(" ".join((*CFLAGS, *LDFLAGS)).encode())
    digest.update(_torch_version_file().read_bytes())
    return default_cache_dir() / f"native-{digest.hexdigest()[:12]}"


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
    snapshot = _snapshot()
    out = _dir_of(snapshot)
    module = _cached(out)
    if module is None:  # not built yet, or a broken build: compile it
        module = _compile(snapshot, out)
    if verbose:
        print((out / "build.log").read_text())
    return module


def _cached(out: Path) -> ModuleType | None:
    """The complete build in `out`, loaded; None where there is none or it does not load."""
    if not (out / STAMP).is_file():
        return None
    try:
        return _load_built(out)
    except (OSError, ImportError):
        return None


def _compile(snapshot: dict[str, bytes], out: Path) -> ModuleType:
    """Compile the snapshot of cuda_ext/ in native-<hash>.<pid>.tmp and rename that to `out` when
    the compiler is done (a failed build too: its build.log is what the error names; the next
    build replaces it). Where another process finished the same build first, its directory stays
    and this one's is dropped; staging directories of killed builds go first."""
    _drop_abandoned(out.parent)
    staging = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    src = staging / "src"
    src.mkdir(parents=True)
    for name, text in snapshot.items():
        (src / name).write_bytes(text)
    log = staging / "build.log"
    try:
        with _output_to(log):
            from torch.utils import cpp_extension  # warns about CUDA on import: into the log

            module = cpp_extension.load(
                name=NAME, sources=[str(src / n) for n in SOURCES],
                extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                build_directory=str(staging), verbose=True)
    except Exception as e:  # the compiler's errors are in the log
        with log.open("a") as f:
            f.write(f"\n{type(e).__name__}: {e}\n")
        _move_into_place(staging, out)
        raise NativeUnavailableError(
            f"the native kernels (cuda_ext/) failed to build (compiler log: {out / 'build.log'})"
        ) from e
    (staging / STAMP).write_text(Path(module.__file__).name + "\n")
    _move_into_place(staging, out)
    return module


def _drop_abandoned(root: Path) -> None:
    """Remove the staging directories of builds whose process is gone (killed mid-compile)."""
    for staging in root.glob("native-*.*.tmp"):
        pid = staging.name.split(".")[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(staging, ignore_errors=True)


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`, replacing a failed or broken build there; a complete build
    there (another process's) is kept and `staging` dropped (this process has loaded its own
    shared object already: the mapping outlives the file)."""
    if (out / STAMP).is_file() and (staging / STAMP).is_file():
        shutil.rmtree(staging, ignore_errors=True)
        return
    shutil.rmtree(out, ignore_errors=True)
    try:
        os.rename(staging, out)
    except OSError:  # another process renamed its build in between
        shutil.rmtree(staging, ignore_errors=True)


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


def _load_built(out: Path) -> ModuleType:
    """The cached build's shared object, imported directly (no compiler, no ninja). The stamp
    names it relative to the directory (builds before session 26 wrote an absolute path)."""
    import importlib.machinery

    import torch  # noqa: F401  (the extension links against libtorch)

    path = str(out / (out / STAMP).read_text().strip())
    loader = importlib.machinery.ExtensionFileLoader(NAME, path)
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def _load() -> ModuleType | NativeUnavailableError:
    try:
        return build()  # the cached build where there is one (a broken one is rebuilt)
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
