"""Per-forward plan of the ragged backend: what each request reads, writes, stages and seals.

Built once per forward pass in `init_forward_metadata` (host-side bookkeeping), read by every
layer. One rule covers prefill chunks, decode and mixed batches. For request r with `prefix`
tokens already cached and `seq_len` after this forward:

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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_ragged.mem_pool.storage import RaggedStorage

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sgl_ragged.attention_backend.batched_torch import PaddedBatch
    from sgl_ragged.attention_backend.tail_batch import TailBatch
    from sgl_ragged.kernels.batch import KernelBatch


@dataclass
class RequestPlan:
    """What one request of the batch does in this forward pass."""

    q_start: int  # first row of this request in the batch's q/k/v
    prefix: int  # tokens cached before this forward
    seq_len: int  # tokens cached after this forward
    tail_start: int  # first position not in sealed rows (page-aligned)
    sealed_pages: torch.Tensor  # [tail_start // P] int64 logical pages, on the device
    prior_stages: torch.Tensor  # [n] int64 staging pages held before, position order, device
    tail_pages: torch.Tensor  # [ceil((seq_len - tail_start) / P)] int64 logical pages (CPU)
    num_seal: int  # the first num_seal tail pages are sealed in this forward
    after_stages: torch.Tensor  # [len(tail_pages) - num_seal] int64 staging pages kept, device
    tail_obs: torch.Tensor  # [T] float32 observation counts of tail tokens after this forward
    obs_queries: int  # window queries (the last ones of this forward) that score the tail

    @property
    def q_len(self) -> int:
        return self.seq_len - self.prefix

    @property
    def tail_len(self) -> int:
        return self.seq_len - self.tail_start


@dataclass
class RaggedForwardMetadata:
    """The whole batch's plan plus the pages to mark sealed after the last layer."""

    requests: list[RequestPlan]
    pages_to_seal: torch.Tensor  # [M] int64 logical pages sealed by this forward (CPU)
    kernel: KernelBatch | None = None  # page tables for the Triton kernels (CUDA path only)
    tails: TailBatch | None = None  # the batch's tail pages (batched implementations)
    padded: list[PaddedBatch] | None = None  # padded runs of requests (batched torch)
    graph: bool = False  # kernel/tails are a captured decode graph's static buffers (graph.py)


def build_metadata(
    forward_batch: ForwardBatch,
    req_to_token: torch.Tensor,
    storage: RaggedStorage,
    window_pages: int,
    obs_window: int,
) -> RaggedForwardMetadata:
    """Plan every request of the batch; allocates staging pages for pages that stay staged."""
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    if forward_batch.forward_mode.is_decode():
        prefixes = [s - 1 for s in seq_lens]
    else:
        prefixes = list(forward_batch.extend_prefix_lens_cpu)
    pool_idx = forward_batch.req_pool_indices.tolist()
    return plan_batch(req_to_token, storage, pool_idx, prefixes, seq_lens, window_pages, obs_window)


def plan_batch(
    req_to_token: torch.Tensor,
    storage: RaggedStorage,
    pool_idx: list[int],
    prefixes: list[int],
    seq_lens: list[int],
    window_pages: int,
    obs_window: int,
) -> RaggedForwardMetadata:
    """`build_metadata` from plain lists: request r = req_to_token row pool_idx[r] goes from
    prefixes[r] to seq_lens[r] cached tokens in this forward."""
    plans, q_start = [], 0
    for r, prefix, seq_len in zip(pool_idx, prefixes, seq_lens, strict=True):
        final = storage.chunk_final.pop(r, True)
        window = window_pages if final else 0
        plans.append(_plan_request(req_to_token[r], storage, q_start, prefix, seq_len, window, obs_window))
        q_start += seq_len - prefix
    sealed = [p.tail_pages[: p.num_seal] for p in plans]
    return RaggedForwardMetadata(
        requests=plans,
        pages_to_seal=torch.cat(sealed) if sealed else torch.empty(0, dtype=torch.long),
    )


def _plan_request(
    row: torch.Tensor,
    storage: RaggedStorage,
    q_start: int,
    prefix: int,
    seq_len: int,
    window: int,
    obs_window: int,
) -> RequestPlan:
    P = storage.layout.page_size
    device = storage.device
    # 1. Pages cached before this forward: a sealed run, then staged pages.
    old_pages = (row[0:prefix:P] // P).cpu().long()
    staged = storage.page_to_stage[old_pages] >= 0
    num_sealed = int((~staged).long().cumsum(0).eq(torch.arange(1, len(old_pages) + 1)).sum())
    _check_prefix(storage, old_pages, num_sealed, staged, prefix, P)
    tail_start = num_sealed * P
    prior_stages = storage.page_to_stage[old_pages[num_sealed:]]
    # 2. Tail pages after this forward; the last `window` complete ones and a partial one stay.
    tail_pages = (row[tail_start:seq_len:P] // P).cpu().long()
    num_complete = seq_len // P - num_sealed
    num_seal = max(0, num_complete - window)
    # 3. Staging pages for the pages that stay (new pages get a fresh one).
    after = []
    for page in tail_pages[num_seal:].tolist():
        s = int(storage.page_to_stage[page])
        after.append(s if s >= 0 else storage.stage(page))
    # 4. Observation counts: earlier counts plus this forward's window queries.
    tail_obs = _tail_obs(storage, prior_stages, tail_start, prefix, seq_len, obs_window)
    after_t = torch.tensor(after, dtype=torch.long)
    _write_obs(storage, after_t, tail_obs, num_seal, P)
    return RequestPlan(
        q_start=q_start,
        prefix=prefix,
        seq_len=seq_len,
        tail_start=tail_start,
        sealed_pages=old_pages[:num_sealed].to(device),
        prior_stages=prior_stages.to(device),
        tail_pages=tail_pages,
        num_seal=num_seal,
        after_stages=after_t.to(device),
        tail_obs=tail_obs.to(device),
        obs_queries=min(obs_window, seq_len - prefix),
    )


def _check_prefix(
    storage: RaggedStorage, old_pages: torch.Tensor, num_sealed: int, staged: torch.Tensor,
    prefix: int, P: int,
) -> None:
    if not storage.sealed[old_pages[:num_sealed]].all():
        raise RuntimeError("a cached page of this request is neither sealed nor staged")
    if not staged[num_sealed:].all():
        raise RuntimeError("a sealed page follows a staged page in a request")
    if num_sealed * P == prefix or staged.any():
        return
    raise RuntimeError(
        f"the cached prefix ({prefix} tokens) ends inside a sealed page of {P} tokens; "
        "the ragged backend needs page-aligned prefixes"
    )


def _tail_obs(
    storage: RaggedStorage, prior_stages: torch.Tensor, tail_start: int, prefix: int,
    seq_len: int, obs_window: int,
) -> torch.Tensor:
    """[T] float32: per tail token, how many queries observed it, this forward included."""
    obs = torch.zeros(seq_len - tail_start)
    if prior_stages.numel():
        obs[: prefix - tail_start] = storage.stage_obs[prior_stages].flatten()[: prefix - tail_start].cpu()
    w = min(obs_window, seq_len - prefix)
    pos = torch.arange(tail_start, seq_len)
    q_pos = torch.arange(seq_len - w, seq_len)
    obs += (q_pos[None, :] >= pos[:, None]).sum(1).float()
    return obs


def _write_obs(
    storage: RaggedStorage, after: torch.Tensor, tail_obs: torch.Tensor, num_seal: int, P: int
) -> None:
    """Store the counts of the pages that stay staged (layer-independent)."""
    for i, s in enumerate(after.tolist()):
        chunk = tail_obs[(num_seal + i) * P : (num_seal + i + 1) * P]
        storage.stage_obs[s].zero_()
        storage.stage_obs[s, : chunk.numel()] = chunk.to(storage.device)
