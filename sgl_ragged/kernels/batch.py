"""Per-forward kernel inputs: the batch's page tables as padded int32 device tensors.

Built once per forward from the backend's request plans (attention_backend/plan.py, read here
through the `PlannedRequest` protocol: kernels/ imports nothing from attention_backend/), read
by every layer. For request b (positions as in attention_backend/plan.py):

    | tensor                 | index space                  | covers positions            |
    |------------------------|------------------------------|-----------------------------|
    | sealed_table[b, :n_s]  | logical pages                | [0, tail_start)             |
    | stage_table[b, :]      | staging pages                | [tail_start, prefix)        |
    | q_start[b] + i         | rows of this forward's q/k/v | prefix + i, i < q_len       |

The tail of b is `num_staged[b]` staged tokens followed by its `q_len[b]` new tokens; query i
sees tail token t iff t <= num_staged[b] + i (causal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.utils.rnn import pad_sequence

from sgl_ragged.transfer import to_device


class PlannedRequest(Protocol):
    """The fields of a request plan (attention_backend/plan.RequestPlan) the kernels read."""

    q_start: int  # first row of the request in q/k/v
    prefix: int  # tokens cached before this forward
    tail_start: int  # first position not in sealed rows
    sealed_pages: torch.Tensor  # [n_s] int64 logical pages
    prior_stages: torch.Tensor  # [n] int64 staging pages held before this forward

    @property
    def q_len(self) -> int: ...


@dataclass(frozen=True)
class KernelBatch:
    q_start: torch.Tensor  # [B] int32 first row of request b in q/k/v
    q_len: torch.Tensor  # [B] int32 new tokens of request b
    num_sealed: torch.Tensor  # [B] int32 sealed logical pages of request b
    sealed_table: torch.Tensor  # [B, max(1, max n_s)] int32 logical pages, padded with 0
    num_staged: torch.Tensor  # [B] int32 staged tokens (prefix - tail_start)
    stage_table: torch.Tensor  # [B, max(1, max staged pages)] int32 staging pages, padded with 0
    max_q_len: int  # host copy of q_len.max() (grid size)
    max_sealed: int  # host copy of num_sealed.max()

    @property
    def batch_size(self) -> int:
        return self.q_start.numel()


def _padded(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[B] int64 tensors of different lengths -> [B, max(1, longest)] int32 on the host,
    padded with 0."""
    rows = [r.to("cpu", torch.int32) for r in rows]
    if not rows or max(r.numel() for r in rows) == 0:
        return torch.zeros(len(rows), 1, dtype=torch.int32)
    return pad_sequence(rows, batch_first=True, padding_value=0)


def kernel_batch(plans: Sequence[PlannedRequest], device: torch.device | str) -> KernelBatch:
    """Kernel inputs for these request plans: built on the host, then one copy to the device
    that does not wait for it (transfer.to_device)."""

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    num_sealed = [p.sealed_pages.numel() for p in plans]
    tables = to_device([
        ints([p.q_start for p in plans]), ints([p.q_len for p in plans]), ints(num_sealed),
        _padded([p.sealed_pages for p in plans]), ints([p.prefix - p.tail_start for p in plans]),
        _padded([p.prior_stages for p in plans]),
    ], device)
    return KernelBatch(
        *tables,
        max_q_len=max((p.q_len for p in plans), default=0),
        max_sealed=max(num_sealed, default=0),
    )
