"""Planning a forward: each request's plan (plan.py) from the batch's lists and the storage's
bookkeeping, then the one step that changes the storage (staging pages for the pages that stay).

`plan_batch` only reads the storage; `take_staging` gives every page that stays staged its
staging page (fresh ones for new pages) and writes its observation counts. The backend runs
both once per forward, before any layer; chunk boundaries (which prefill chunks are a
request's last) come in explicitly, from chunks.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.mem_pool.storage import RaggedStorage


def plan_batch(
    req_to_token: torch.Tensor,
    storage: RaggedStorage,
    pool_idx: Sequence[int],
    prefixes: Sequence[int],
    seq_lens: Sequence[int],
    window_pages: int,
    obs_window: int,
    final: Sequence[bool] | None = None,
) -> BatchPlan:
    """Plan every request of a batch (reads the storage, allocates nothing): request r =
    req_to_token row pool_idx[r] goes from prefixes[r] to seq_lens[r] cached tokens in this
    forward; final[r]: its extend is its last prefill chunk (None: all are). The plan's new
    staged pages have no staging page yet (`take_staging`)."""
    if final is None:
        final = [True] * len(pool_idx)
    plans, q_start = [], 0
    for r, prefix, seq_len, last in zip(pool_idx, prefixes, seq_lens, final, strict=True):
        window = window_pages if last else 0
        plans.append(_plan_request(req_to_token[r], storage, q_start, prefix, seq_len, window, obs_window))
        q_start += seq_len - prefix
    sealed = [p.tail_pages[: p.num_seal] for p in plans]
    return BatchPlan(
        requests=plans,
        pages_to_seal=torch.cat(sealed) if sealed else torch.empty(0, dtype=torch.long),
        staged=False,
    )


def take_staging(storage: RaggedStorage, plan: BatchPlan) -> BatchPlan:
    """The plan with a staging page for every tail page that stays (new pages get a fresh,
    zeroed one, in request and position order) and their observation counts written: the
    only step of planning that changes the storage."""
    if plan.staged:
        return plan
    P, device = storage.layout.page_size, storage.device
    requests = []
    for p in plan.requests:
        stays = p.tail_pages[p.num_seal :].tolist()
        after = torch.tensor([s if s >= 0 else storage.stage(page)
                              for page, s in zip(stays, p.after_stages.tolist(), strict=True)],
                             dtype=torch.long)
        _write_obs(storage, after, p.tail_obs, p.num_seal, P)
        requests.append(replace(p, after_stages=after.to(device), tail_obs=p.tail_obs.to(device)))
    return replace(plan, requests=requests, staged=True)


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
    # 3. Staging pages the staying pages hold already (-1 for new ones: take_staging's job).
    held = storage.page_to_stage.index_select(0, tail_pages[num_seal:])
    # 4. Observation counts: earlier counts plus this forward's window queries.
    tail_obs = _tail_obs(storage, prior_stages, tail_start, prefix, seq_len, obs_window)
    return RequestPlan(
        q_start=q_start,
        prefix=prefix,
        seq_len=seq_len,
        tail_start=tail_start,
        sealed_pages=old_pages[:num_sealed].to(device),
        prior_stages=prior_stages.to(device),
        tail_pages=tail_pages,
        num_seal=num_seal,
        after_stages=held,
        tail_obs=tail_obs,
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
        obs[: prefix - tail_start] = storage.stats.obs[prior_stages].flatten()[: prefix - tail_start].cpu()
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
        storage.write_obs(s, tail_obs[(num_seal + i) * P : (num_seal + i + 1) * P])
