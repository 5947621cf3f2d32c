"""compat/import_hook.py: the venv's startup hook skips GPU_ONLY packages where torch is imported
and sees no GPU, imports them everywhere else, and says how to have them imported.

Fake packages stand in for FlashInfer, ml_dtypes and CUTLASS's DSL in fresh interpreters that
read the hook's ``.pth`` as site.py does (torch told there is no GPU); the last test imports
SGLang's quantization modules and model registry in this venv (its hook written by
scripts/env.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from sgl_ragged.compat import import_hook

NO_GPU = "import torch\ntorch.cuda.is_available = lambda: False\n"  # as on a CPU machine


def _run(root: Path, check: str) -> None:
    """Run `check` in a fresh interpreter with the hook's .pth read from `root`/site, fake
    GPU_ONLY packages (each sets REAL = True) importable from `root`."""
    site_dir = root / "site"
    site_dir.mkdir()
    import_hook.write_import_hook(site_dir)
    for name in import_hook.GPU_ONLY:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("REAL = True\n")
    code = f"import site, sys\nsite.addsitedir({str(site_dir)!r})\n" + check
    # -S: this .pth alone, not the venv's; torch and this package found on PYTHONPATH instead
    path = [str(root), str(Path(import_hook.__file__).parents[2]), sysconfig.get_paths()["purelib"]]
    env = {"PYTHONPATH": os.pathsep.join(path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("name", import_hook.GPU_ONLY)
def test_skipped_where_torch_sees_no_gpu(tmp_path: Path, name: str) -> None:
    _run(tmp_path, NO_GPU + (
        "import importlib.util\n"
        f"try:\n    import {name}\nexcept ImportError as e:\n    error = e\n"
        "else:\n    raise AssertionError('imported')\n"
        f"assert isinstance(error, ModuleNotFoundError) and error.name == {name!r}, error\n"
        f"assert {import_hook.ENV + '=import'!r} in str(error)\n"
        f"assert {name!r} not in sys.modules\n"
        # SGLang's is_flashinfer_available asks find_spec first: it must answer, not raise
        f"assert importlib.util.find_spec({name!r}) is not None\n"))


def test_imported_before_torch_without_importing_it(tmp_path: Path) -> None:
    imports = "".join(f"import {name}\nassert {name}.REAL\n" for name in import_hook.GPU_ONLY)
    _run(tmp_path, imports + "assert 'torch' not in sys.modules\n")


@pytest.mark.parametrize("first", ["torch", "sgl_kernel"])
def test_torch_imports_under_the_hook(tmp_path: Path, first: str) -> None:
    """torch's own import looks `cutlass` up (torch._native's CuTe DSL check) while it is
    half-initialized, and `import sgl_kernel` imports torch from inside sgl_kernel_cpu: the hook
    answers GPU_ONLY names from import_hook, which imports no torch, not from sgl_kernel_cpu
    (half-initialized there: AttributeError)."""
    _run(tmp_path, f"import {first}\nimport torch\n" + NO_GPU +
         "import importlib.util\n"
         "assert importlib.util.find_spec('cutlass') is not None\n"
         f"assert ('sgl_ragged.compat.sgl_kernel_cpu' in sys.modules) == {first == 'sgl_kernel'}\n")


def test_imported_where_there_is_a_gpu_or_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(import_hook.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert import_hook.gpu_only_spec("flashinfer") is not None
    monkeypatch.setenv(import_hook.ENV, "import")
    assert import_hook.gpu_only_spec("flashinfer") is None
    monkeypatch.setenv(import_hook.ENV, "skip")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert import_hook.gpu_only_spec("flashinfer") is None


def test_a_bad_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(import_hook.ENV, "yes")
    with pytest.raises(ValueError, match="RAGGED_GPU_ONLY_IMPORTS=yes is not a choice"):
        import_hook.gpu_only_spec("ml_dtypes")


def test_other_names_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert import_hook.gpu_only_spec("flashinfer_extra") is None
    assert import_hook.gpu_only_spec("numpy") is None


def test_sglang_imports_without_them() -> None:
    """SGLang's quantization modules import FlashInfer in a try block and tvm_ffi ml_dtypes, its
    model registry CUTLASS's DSL (Inkling): on this machine none is imported, SGLang's own check
    finds FlashInfer unavailable, and the registry keeps the rest (the venv's .pth is
    scripts/env.sh's; skipped where torch sees a GPU)."""
    code = ("import sys, torch\n"
            "if torch.cuda.is_available():\n    sys.exit(0)\n"
            "import sglang.srt.layers.quantization\n"
            "from sglang.srt.utils import is_flashinfer_available\n"
            "assert not is_flashinfer_available()\n"
            "from sglang.srt.models.registry import ModelRegistry\n"
            "archs = ModelRegistry.get_supported_archs()\n"
            "assert 'LlamaForCausalLM' in archs and 'Qwen2VLForConditionalGeneration' in archs\n"
            f"left = [m for m in sys.modules if m.split('.')[0] in {import_hook.GPU_ONLY!r}]\n"
            "assert not left, left\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
