"""Resident programs per SM of a compiled kernel: the N_CTA of the AOT split map (aot.py).

N_CTA = SMs x programs of the decode split kernel that one SM holds at once. How many it holds
follows from the compiled kernel's registers per thread, shared memory and warps against the
SM's limits -- the CUDA occupancy calculation, done once at server start from the compiled
kernel (kernels/decode.py `split_kernel_resources`). No Triton import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

WARP = 32


@dataclass(frozen=True)
class KernelResources:
    """What one program of a compiled kernel occupies."""

    registers_per_thread: int
    shared_bytes: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.registers_per_thread < 0 or self.shared_bytes < 0 or self.num_warps < 1:
            raise ValueError(f"impossible kernel resources: {self}")


@dataclass(frozen=True)
class SMLimits:
    """Per-SM limits (defaults: sm_80 / sm_90). Registers are allocated per warp in units of
    `register_unit`; each program also reserves `shared_reserved` bytes of shared memory."""

    registers: int = 65536
    threads: int = 2048
    shared_bytes: int = 228 * 1024
    max_programs: int = 32
    register_unit: int = 256
    shared_reserved: int = 1024

    @classmethod
    def of(cls, device: torch.device | str) -> SMLimits:
        """The limits torch reports for a CUDA device (defaults where it reports none)."""
        props = torch.cuda.get_device_properties(device)
        default = cls()
        return cls(
            registers=getattr(props, "regs_per_multiprocessor", default.registers),
            threads=getattr(props, "max_threads_per_multi_processor", default.threads),
            shared_bytes=getattr(props, "shared_memory_per_multiprocessor", default.shared_bytes),
        )


def programs_per_sm(kernel: KernelResources, sm: SMLimits) -> int:
    """Programs of `kernel` resident on one SM at once: the tightest of the register, thread,
    shared-memory and program-count limits (at least 1)."""
    warp_registers = math.ceil(kernel.registers_per_thread * WARP / sm.register_unit) * sm.register_unit
    limits = [sm.threads // (WARP * kernel.num_warps), sm.max_programs]
    if warp_registers:
        limits.append(sm.registers // warp_registers // kernel.num_warps)
    if kernel.shared_bytes:
        limits.append(sm.shared_bytes // (kernel.shared_bytes + sm.shared_reserved))
    return max(1, min(limits))
