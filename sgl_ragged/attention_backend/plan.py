"""What one forward does, request by request: the plan every implementation reads.

A leaf module (torch only). Built once per forward by planner.py, read by every layer. For
request r with `prefix` tokens already cached and `seq_len` after this forward:

    | positions                       | where the K/V lives during this forward           |
    |---------------------------------|---------------------------------------------------|
    | [0, tail_start)                 | sealed rows (compressed before this forward)      |
    | [tail_start, prefix)            | staging pages the request already held            |
    | [prefix, seq_len)               | this forward's activations (k, v of the chunk)    |

The "tail" [tail_start, seq_len) is page-aligned at its start. After the forward, the last
`window` complete pages and the partial last page stay staged; the tail's earlier pages are
sealed (window = --ragged-window-pages, or 0 for a prefill chunk that is not the last one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestPlan:
    """What one request of the batch does in this forward pass."""

    q_start: int  # first row of this request in the batch's q/k/v
    prefix: int  # tokens cached before this forward
    seq_len: int  # tokens cached after this forward
    tail_start: int  # first position not in sealed rows (page-aligned)
    # The plan's tensors are host tensors as the planner builds them (each implementation's
    # `prepare` moves what its kernels read in one copy: transfer.to_device); tests may pass
    # them on the device, which every reader accepts.
    sealed_pages: torch.Tensor  # [tail_start // P] int64 logical pages
    prior_stages: torch.Tensor  # [n] int64 staging pages held before, position order
    tail_pages: torch.Tensor  # [ceil((seq_len - tail_start) / P)] int64 logical pages
    num_seal: int  # the first num_seal tail pages are sealed in this forward
    # [len(tail_pages) - num_seal] int64 staging pages of the pages that stay (from
    # planner.plan_batch: -1 for pages that get one in planner.take_staging)
    after_stages: torch.Tensor
    tail_obs: torch.Tensor  # [T] float32 observation counts of tail tokens after this forward
    obs_queries: int  # window queries (the last ones of this forward) that score the tail

    @property
    def q_len(self) -> int:
        return self.seq_len - self.prefix

    @property
    def tail_len(self) -> int:
        return self.seq_len - self.tail_start


@dataclass(frozen=True)
class BatchPlan:
    """The whole batch's plan plus the pages to mark sealed after the last layer."""

    requests: list[RequestPlan]
    pages_to_seal: torch.Tensor = field(  # [M] int64 logical pages sealed by this forward (CPU)
        default_factory=lambda: torch.empty(0, dtype=torch.long))
    staged: bool = True  # every page that stays has its staging page (planner.take_staging)
