"""Small tensor ops shared by the torch reference and the fast paths (torch only)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def take(x: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """x indexed along `dim` by an index of any shape, like x[index] for dim 0, through
    index_select: on a CPU, advanced indexing of small tensors costs a parallel region each
    (tens of microseconds), index_select does not."""
    out = x.index_select(dim, index.reshape(-1))
    return out.view(*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])


def pad_to_pages(x: torch.Tensor, P: int) -> torch.Tensor:
    """A 1-D x with zeros appended up to a multiple of P (whole pages)."""
    return torch.nn.functional.pad(x, (0, -x.numel() % P))


def query_heads(kv_heads: torch.Tensor, group_size: int) -> torch.Tensor:
    """[H_p] KV heads -> [H_p * G] query heads reading them, in SDPA's GQA order."""
    offsets = torch.arange(group_size, device=kv_heads.device)
    return (kv_heads[:, None] * group_size + offsets[None, :]).flatten()


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n inside the block (restored after): small ops on
    a CPU cost more in waking the pool (OMP_WAIT_POLICY=PASSIVE) than the other cores give."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
