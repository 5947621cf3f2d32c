"""Planning a forward: each request's plan (plan.py) from the batch's lists and the storage's
bookkeeping, then the one step that changes the storage (staging pages for the pages that stay).

`plan_batch` only reads the storage; `take_staging` gives every page that stays staged its
staging page (fresh ones for new pages) and writes its observation counts. The backend runs
both once per forward, before any layer; chunk boundaries (which prefill chunks are a
request's last) come in explicitly, from chunks.py.

Both run on host arrays: the batch's logical pages come to the host in one copy (numpy views of
it and of the storage's host bookkeeping, `page_to_stage`, `sealed` and the staging pages'
observation counts, which StagingStats keeps on the host), and the counts of the pages that
stay go back in one host write. A decode step of 16 requests plans in a fraction of the time per-request
torch ops took (each a few microseconds on a CPU, ~25 of them a request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from sgl_ragged.attention_backend.ops import pad_to_pages
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.transfer import to_device


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
    if not (len(pool_idx) == len(prefixes) == len(seq_lens) == len(final)):
        raise ValueError(f"plan_batch: {len(pool_idx)} requests but {len(prefixes)} prefixes, "
                         f"{len(seq_lens)} seq_lens and {len(final)} final flags")
    P = storage.layout.page_size
    pages = _logical_pages(req_to_token, pool_idx, seq_lens, P, storage.scheduler_stream)
    to_stage = storage.page_to_stage.numpy()
    # 1. Pages cached before this forward: a sealed run, then staged pages.
    tails = []
    for b, prefix in enumerate(prefixes):
        old = pages[b, : -(-prefix // P)]
        stages = to_stage[old]
        staged = stages >= 0
        num_sealed = int(staged.argmax()) if staged.any() else len(old)
        _check_prefix(storage, old, num_sealed, staged, prefix, P)
        tails.append((num_sealed, stages[num_sealed:]))
    # 2. What the staging pages held observed before (one gather for the batch).
    held_obs = _staged_obs(storage, [prior for _, prior in tails])
    plans, q_start = [], 0
    for b, (prefix, seq_len, last) in enumerate(zip(prefixes, seq_lens, final, strict=True)):
        num_sealed, prior = tails[b]
        tail_start = num_sealed * P
        # 3. Tail pages after this forward; the last `window` complete ones and a partial one
        # stay (window 0 for a prefill chunk that is not the request's last).
        tail = pages[b, num_sealed : num_sealed + -(-(seq_len - tail_start) // P)]
        num_seal = max(0, seq_len // P - num_sealed - (window_pages if last else 0))
        w = min(obs_window, seq_len - prefix)
        plans.append(RequestPlan(
            q_start=q_start,
            prefix=prefix,
            seq_len=seq_len,
            tail_start=tail_start,
            sealed_pages=torch.from_numpy(pages[b, :num_sealed]),
            prior_stages=torch.from_numpy(prior),
            tail_pages=torch.from_numpy(tail),
            num_seal=num_seal,
            # 4. Staging pages the staying pages hold already (-1 for new ones: take_staging's job).
            after_stages=torch.from_numpy(to_stage[tail[num_seal:]]),
            tail_obs=torch.from_numpy(_tail_obs(held_obs[b], tail_start, prefix, seq_len, w)),
            obs_queries=w,
        ))
        q_start += seq_len - prefix
    return BatchPlan(
        requests=plans,
        pages_to_seal=torch.from_numpy(np.concatenate(
            [p.tail_pages[: p.num_seal].numpy() for p in plans] or [np.empty(0, np.int64)])),
        staged=False,
    )


def take_staging(storage: RaggedStorage, plan: BatchPlan) -> BatchPlan:
    """The plan with a staging page for every tail page that stays (new pages get a fresh,
    zeroed one, in request and position order) and their observation counts written: the
    only step of planning that changes the storage."""
    if plan.staged:
        return plan
    P = storage.layout.page_size
    requests, stages, counts = [], [], []
    for p in plan.requests:
        stays = p.tail_pages[p.num_seal :].tolist()
        after = [s if s >= 0 else storage.stage(page)
                 for page, s in zip(stays, p.after_stages.tolist(), strict=True)]
        stages += after
        counts.append(pad_to_pages(p.tail_obs, P).view(-1, P)[p.num_seal :])
        requests.append(replace(p, after_stages=torch.tensor(after, dtype=torch.long)))
    if stages:  # every staying page's counts (the rest of a page zero), layer-independent
        storage.write_obs_pages(torch.tensor(stages, dtype=torch.long), torch.cat(counts))
    return replace(plan, requests=requests, staged=True)


def _logical_pages(req_to_token: torch.Tensor, pool_idx: Sequence[int],
                   seq_lens: Sequence[int], P: int,
                   writer: torch.cuda.Stream | None = None) -> np.ndarray:
    """[B, ceil(max seq_len / P)] int64 (host): the logical page of each request's page-sized
    run of positions (req_to_token's slot of the run's first position // P), one copy. On
    CUDA the copy runs on a stream of its own behind `writer`, the stream req_to_token was
    written on (RaggedStorage.scheduler_stream), so the host waits for those writes and not
    for the forward in flight on the current stream (without it: behind the current stream)."""
    n = max((-(-s // P) for s in seq_lens), default=0)
    if not len(pool_idx):
        return np.empty((0, n), dtype=np.int64)
    rows = torch.tensor(pool_idx, dtype=torch.long)
    if not req_to_token.is_cuda:
        first = req_to_token.index_select(0, rows.to(req_to_token.device))[:, 0 : n * P : P]
        return (first // P).long().cpu().numpy()
    device = req_to_token.device
    reader = _reader_stream(device)
    reader.wait_stream(writer if writer is not None else torch.cuda.current_stream(device))
    with torch.cuda.stream(reader):
        (index,) = to_device([rows], device)
        first = req_to_token.index_select(0, index)[:, 0 : n * P : P] // P
        host = torch.empty(first.shape, dtype=first.dtype, pin_memory=True)
        host.copy_(first, non_blocking=True)
    reader.synchronize()
    return host.long().numpy()


_READERS: dict[torch.device, torch.cuda.Stream] = {}


def _reader_stream(device: torch.device) -> torch.cuda.Stream:
    """The planner's own CUDA stream on this device (req_to_token reads, `_logical_pages`)."""
    if device not in _READERS:
        _READERS[device] = torch.cuda.Stream(device)
    return _READERS[device]


def _staged_obs(storage: RaggedStorage, priors: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per request, [n, P] float32 (host): the observation counts its n prior staging pages
    hold (one gather for the batch, on the host where StagingStats keeps them)."""
    sizes = [len(p) for p in priors]
    if not sum(sizes):
        return [np.empty((0, storage.layout.page_size), dtype=np.float32) for _ in priors]
    rows = storage.stats.obs.numpy()[np.concatenate(priors)]
    return np.split(rows, np.cumsum(sizes)[:-1])


def _check_prefix(
    storage: RaggedStorage, old_pages: np.ndarray, num_sealed: int, staged: np.ndarray,
    prefix: int, P: int,
) -> None:
    if not storage.sealed.numpy()[old_pages[:num_sealed]].all():
        raise RuntimeError("a cached page of this request is neither sealed nor staged")
    if not staged[num_sealed:].all():
        raise RuntimeError("a sealed page follows a staged page in a request")
    if num_sealed * P == prefix or staged.any():
        return
    raise RuntimeError(
        f"the cached prefix ({prefix} tokens) ends inside a sealed page of {P} tokens; "
        "the ragged backend needs page-aligned prefixes"
    )


def _tail_obs(held: np.ndarray, tail_start: int, prefix: int, seq_len: int,
              w: int) -> np.ndarray:
    """[T] float32: per tail token, how many queries observed it, this forward's w window
    queries (positions seq_len - w .. seq_len - 1) included; held [n, P]: what its staged
    pages counted before."""
    obs = np.zeros(seq_len - tail_start, dtype=np.float32)
    obs[: prefix - tail_start] = held.reshape(-1)[: prefix - tail_start]
    # the queries at or after position t: w of them, or the seq_len - t from t on
    obs += np.minimum(w, seq_len - np.arange(tail_start, seq_len)).astype(np.float32)
    return obs

