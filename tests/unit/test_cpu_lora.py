"""compat/cpu_lora: SGLang's LoRA adapters on the CPU (the backend it picks, pinning as a no-op).
Served end to end in tests/e2e/test_lora.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from sgl_ragged.compat import cpu_lora

pytest.importorskip("sglang")


@pytest.mark.parametrize("device,enabled,backend,want", [
    ("cpu", True, "csgmv", "torch_native"),  # SGLang's default: replaced
    ("cpu", True, "torch_native", None),
    ("cpu", False, "csgmv", None),  # no adapters: nothing to change
    ("cuda", True, "csgmv", None),
    ("cuda", True, "triton", None),
])
def test_backend_for_a_server(device, enabled, backend, want):
    assert cpu_lora.lora_backend_for(device, enabled, backend) == want


@pytest.mark.parametrize("backend", ["triton", "triton_v2"])
def test_explicit_triton_backends_are_refused_on_the_cpu(backend):
    with pytest.raises(ValueError, match=f"--lora-backend {backend} runs Triton kernels.*"
                                         "--lora-backend torch_native"):
        cpu_lora.lora_backend_for("cpu", True, backend)


@pytest.mark.parametrize("fields,declared", [
    ({"enable_lora": None, "lora_paths": ["a=/x"]}, True),  # --lora-paths alone enables LoRA
    ({"enable_lora": True, "lora_paths": None}, True),
    ({"enable_lora": None, "lora_paths": None}, False),
])
def test_resolution_declares_the_cpu_backend(fields, declared):
    server_args = SimpleNamespace()
    cfg = SimpleNamespace(device="cpu", lora_backend="csgmv", **fields)
    cpu_lora.resolve(server_args, cfg)
    stash = getattr(server_args, "_resolved_overrides", [])
    assert stash == ([("sgl_ragged.cpu_lora", {"lora_backend": "torch_native"})] if declared
                     else [])


def test_pinning_is_a_no_op_once_installed():
    # In a child: install_unpinned changes torch.Tensor for the whole process.
    code = textwrap.dedent("""
        import importlib, torch
        from sgl_ragged.compat import cpu_lora
        modules = [importlib.import_module(m) for m in cpu_lora.PINNING_MODULES]
        cuda = torch.cuda.is_available()
        if not cuda:
            for call in (lambda: torch.ones(2).pin_memory(),
                         lambda: modules[0].torch.tensor([1], pin_memory=True)):
                try:
                    call()
                except RuntimeError:
                    pass
                else:
                    raise SystemExit("pinning worked before the shim: nothing to test")
        cpu_lora.install_unpinned()
        cpu_lora.install_unpinned()  # idempotent
        t = torch.arange(4, dtype=torch.int32)
        assert t.pin_memory() is t
        for m in modules:
            assert m.torch.int32 is torch.int32 and m.torch.cat is torch.cat
            for made in (m.torch.tensor([0, 3], dtype=torch.int32, device="cpu", pin_memory=True),
                         m.torch.zeros((2,), dtype=torch.int32, pin_memory=True)):
                assert made.dtype == torch.int32 and made.shape == (2,)
        assert torch.tensor is not modules[0].torch.tensor  # torch itself keeps its factories
        print("ok", cuda)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")
