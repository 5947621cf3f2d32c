"""SGLang's LoRA adapters (--enable-lora, --lora-paths) on a machine without a GPU.

Two things stop SGLang 0.5.23 from serving an adapter on the CPU, with any attention backend:

- Its default LoRA kernels (`--lora-backend csgmv`, and `triton`, `triton_v2`) are Triton
  kernels; on the CPU the first forward fails looking up their tuning file by GPU name
  ("'NoneType' object has no attribute 'replace'"). `torch_native` is its pure-torch backend.
  `resolve` picks it on a CPU server where the default was left, and refuses an explicit
  Triton backend there with what to pass instead.
- Its LoRA layers and the torch_native backend stage small index tensors in pinned host
  memory (`pin_memory=True`, `.pin_memory()`), which torch refuses where no CUDA device is
  present ("Found no NVIDIA driver on your system"). Pinned memory only speeds host-to-device
  copies, and on the CPU there are none: `init_lora_manager`, around ModelRunner's, makes
  pinning a no-op in a process without CUDA before the adapters' layers are built.

The plugin installs both in every SGLang process of the environment, so a stock server there
serves adapters as a ragged one does (tests/e2e/test_lora.py compares the two).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

CPU_LORA_BACKEND = "torch_native"
DEFAULT_LORA_BACKEND = "csgmv"  # SGLang 0.5.23's --lora-backend default
TRITON_LORA_BACKENDS = ("csgmv", "triton", "triton_v2")

# SGLang modules that pass pin_memory=True to torch's factories.
PINNING_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def lora_backend_for(device: str | None, enabled: bool, backend: str) -> str | None:
    """The --lora-backend a server on `device` should use instead of `backend`, or None to
    keep it. ValueError for an explicit Triton backend on the CPU."""
    if device != "cpu" or not enabled or backend not in TRITON_LORA_BACKENDS:
        return None
    if backend != DEFAULT_LORA_BACKEND:
        raise ValueError(
            f"--lora-backend {backend} runs Triton kernels, which need a GPU; on --device cpu "
            f"use --lora-backend {CPU_LORA_BACKEND} (or leave the flag out: the CPU default)")
    return CPU_LORA_BACKEND


def resolve(server_args: Any, cfg: Any) -> None:
    """During SGLang's argument resolution: a CPU server with adapters gets the torch_native
    LoRA backend where it left the (Triton) default."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    enabled = bool(getattr(cfg, "enable_lora", False) or getattr(cfg, "lora_paths", None))
    backend = lora_backend_for(getattr(cfg, "device", None), enabled,
                               getattr(cfg, "lora_backend", DEFAULT_LORA_BACKEND))
    if backend is not None:
        logger.info("--device cpu: LoRA adapters on --lora-backend %s (SGLang's default, "
                    "%s, runs Triton kernels)", backend, DEFAULT_LORA_BACKEND)
        declare_resolution(server_args, "sgl_ragged.cpu_lora", lora_backend=backend)


def init_lora_manager(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ModelRunner.init_lora_manager: without CUDA, pinning is a no-op first."""
    if not torch.cuda.is_available():
        install_unpinned()
    return original(*args, **kwargs)


class _UnpinnedTorch:
    """`torch` for a module that pins: the factories drop pin_memory, the rest is torch."""

    def __init__(self, real: Any) -> None:
        self._real = real
        for name in _FACTORIES:
            setattr(self, name, _unpinned(getattr(real, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _unpinned(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


def _same_tensor(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def install_unpinned() -> None:
    """Make pinning a no-op for SGLang's LoRA code in this process (one without CUDA, where it
    can only raise): its modules' factories drop pin_memory, and Tensor.pin_memory returns
    the tensor itself (the adapters' weights are pinned by method). Idempotent."""
    for name in PINNING_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _UnpinnedTorch):
            module.torch = _UnpinnedTorch(torch)
    if torch.Tensor.pin_memory is not _same_tensor:
        torch.Tensor.pin_memory = _same_tensor  # type: ignore[method-assign]
