"""Small tensor ops shared by the torch reference and the fast paths (torch only)."""

from __future__ import annotations

import torch


def take(x: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """x indexed along `dim` by an index of any shape, like x[index] for dim 0, through
    index_select: on a CPU, advanced indexing of small tensors costs a parallel region each
    (tens of microseconds), index_select does not."""
    out = x.index_select(dim, index.reshape(-1))
    return out.view(*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])


def query_heads(kv_heads: torch.Tensor, group_size: int) -> torch.Tensor:
    """[H_p] KV heads -> [H_p * G] query heads reading them, in SDPA's GQA order."""
    offsets = torch.arange(group_size, device=kv_heads.device)
    return (kv_heads[:, None] * group_size + offsets[None, :]).flatten()
