"""Host tensors to a device in one copy that does not wait for the device.

A forward's plan and its tables are built on the host (planner.py, kernels/batch.py,
attention_backend/tail_batch.py). Moving each of them with `.to(device)` is a copy from pageable
memory, which on CUDA synchronizes the current stream: under SGLang's overlap scheduler that
stream still runs the previous forward, so the host would wait for it before it could plan the
next one. `to_device` packs the tensors into one pinned buffer (each segment 8-byte aligned, so
every dtype can be viewed back in place) and copies it without blocking; the views it returns
are ordered on the current stream like any other work queued there. PyTorch's pinned-memory
cache keeps the buffer until that copy is done. A leaf module (torch only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_ALIGN = 8  # bytes: the largest element size among the tables' dtypes (int64, float32, bool)


def pack(tensors: Sequence[torch.Tensor], pin: bool = False,
         ) -> tuple[torch.Tensor, list[tuple[int, int, torch.dtype, torch.Size]]]:
    """The tensors' bytes in one uint8 buffer [total] (pinned with `pin`), and per tensor its
    (byte offset, byte count, dtype, shape) in it."""
    spans, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        spans.append((offset, nbytes, t.dtype, t.shape))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for t, (start, nbytes, _, _) in zip(tensors, spans, strict=True):
        if nbytes:
            buffer[start : start + nbytes].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return buffer, spans


def unpack(buffer: torch.Tensor,
           spans: Sequence[tuple[int, int, torch.dtype, torch.Size]]) -> list[torch.Tensor]:
    """`pack`'s tensors as views of buffer (on whatever device it is)."""
    return [buffer[start : start + nbytes].view(dtype).view(shape)
            for start, nbytes, dtype, shape in spans]


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The tensors on `device`: on a CPU as they are (`.to`), on CUDA as views of one pinned,
    non-blocking copy (module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    buffer, spans = pack(tensors, pin=True)
    return unpack(buffer.to(device, non_blocking=True), spans)
