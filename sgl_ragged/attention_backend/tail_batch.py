"""The batch's tails as one flat set of pages: staging and sealing for every request at once.

`tail_batch` runs once per forward (layer-independent bookkeeping from the request plans);
`store_tails` then does one layer's staging and sealing for the whole batch with a fixed number
of batched tensor ops and one sealing call -- no loop over requests. A forward whose sealed
pages were all staged before it (decode) may instead stage in place (`stage_fresh`: only its new
tokens' slots, and the padding of pages new to the staging; staged tokens stay as they are), the
same staging state as `store_tails`' whole-page writes: a staging page holds zeros past its
request's end from its first write on (both writers zero them there), and only that request
writes it. (No reader looks past a request's end: the attention, the window statistics and
sealing stop at its last token.) It is the batched form of
`torch_ref.store_tail`, which stays the oracle; both write through the storage's write API
(`RaggedStorage.seal`: its sealer selects, its row writer writes -- torch, or the sealing
kernel on the Triton path; `stage_kv`, `store_stats`).

Tail page m (M in all: request 0's tail pages first, each request's in position order):

    | tensor               | shape  | meaning                                                  |
    |----------------------|--------|----------------------------------------------------------|
    | page_req[m]          | [M]    | batch index b of the page's request                      |
    | page_start[m]        | [M]    | sequence position of the page's first token              |
    | prior_stage[m]       | [M]    | staging page the page held before this forward, or 0     |
    | staged[m, i]         | [M, P] | token i was staged before (lives in prior_stage[m])      |
    | fresh[m, i]          | [M, P] | token i is this forward's: row new_row[m, i] of q/k/v    |
    | source_row[m, i]     | [M, P] | where `tail_pages` reads token i (see TailBatch)         |
    | obs[m, i]            | [M, P] | queries that observed token i, this forward included     |

Tokens neither staged nor fresh are padding past the request's end (zeros). The window of a
request is its last obs_queries queries (`window_tables`); page m's are rows page_win_row[m, j]
of q, j < w_max (the longest window), and page_sees / page_saw say which are real and what they
saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from sgl_ragged.attention_backend.ops import pad_to_pages, take
from sgl_ragged.attention_backend.plan import RequestPlan
from sgl_ragged.mem_pool.sealer import SealBatch
from sgl_ragged.mem_pool.staging_stats import StagedQueryStats, page_stats
from sgl_ragged.mem_pool.storage import RaggedStorage, RowCopy
from sgl_ragged.transfer import to_device


@dataclass(frozen=True)
class TailBatch:
    """Per-forward index tensors of the batch's tail pages (all on the storage's device)."""

    page_req: torch.Tensor  # [M] int64 batch index b
    page_start: torch.Tensor  # [M] int64 position of the first token
    prior_stage: torch.Tensor  # [M] int64 staging page held before (0 where none; see staged)
    has_prior: torch.Tensor  # [M] bool the page held a staging page before this forward
    staged: torch.Tensor  # [M, P] bool token is in prior_stage's staging page
    fresh: torch.Tensor  # [M, P] bool token is this forward's
    new_row: torch.Tensor  # [M, P] int64 row of q/k/v (0 where not fresh)
    source_row: torch.Tensor  # [M, P] int64 the token's row in `_gather`'s table: 1 + new_row
    # (fresh), m * P + i counted from the staged block (staged), 0 (padding: the zero row)
    obs: torch.Tensor  # [M, P] float32 observation counts after this forward
    page_win_row: torch.Tensor  # [M, w_max] int64 rows of q of the page's request's window
    page_sees: torch.Tensor  # [M, w_max, P] bool window query j saw token i (causal, valid)
    page_saw: torch.Tensor  # [M, w_max] float32 window query j saw the page's first token
    page_win_pos: torch.Tensor  # [M, w_max] int64 their positions (-1: no such query)
    n_staged: torch.Tensor  # [M] int64 tokens of the page staged before (staged.sum(1))
    held_stage: torch.Tensor  # [M] int64 prior_stage, -1 where the page held none
    seal_index: torch.Tensor  # [N] int64 tail pages (indices m) sealed by this forward
    seal_pages: torch.Tensor  # [N] int64 their logical pages
    stay_index: torch.Tensor  # [K] int64 tail pages that stay staged
    stay_stage: torch.Tensor  # [K] int64 their staging pages after this forward
    num_seal: int  # N (host copy)
    num_stay: int  # K (host copy)
    counted: bool = True  # seals are counted when sealed (False: a graph's buffers, graph.py)
    # In place (`stage_fresh`; only where tail_batch was asked for it and the pages it seals
    # were wholly staged before: decode with a window):
    in_place: bool = False  # every page reads its K/V from one staging page (page_stage)
    page_stage: torch.Tensor | None = None  # [M] int64 that page: the one a sealed page held,
    # the one a staying page keeps
    write_slot: torch.Tensor | None = None  # [F] int64 staging slots (stage * P + i) of the
    # fresh tokens, and of the padding of pages that held no staging page before
    write_row: torch.Tensor | None = None  # [F] int64 their rows of k/v (-1: padding, zeros)
    page_rows: torch.Tensor | None = None  # [M] int64 tokens of the page staged or fresh (the
    # rows a reader sees; zeros past them)


def tail_batch(plans: Sequence[RequestPlan], page_size: int, device: torch.device,
               in_place: bool = False) -> TailBatch:
    """Index tensors for these plans. in_place: also the tables of `stage_fresh` where the
    forward allows it (the pages it seals hold no fresh token and each page keeps its staging
    page). Built on the host in numpy (`_host_tail_batch`: a few dozen array ops instead of as
    many torch ops, each several times dearer on tensors this small), then on another device
    in one copy that does not wait for it (transfer.to_device: the torch form,
    `_device_tail_batch`, read the device back and synchronized the forward in flight at
    every table; it stays as the numpy form's oracle in tests/unit/test_tail_batch.py)."""
    batch = _host_tail_batch(plans, page_size, in_place)
    if torch.device(device).type == "cpu":
        return batch
    names = [f.name for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
    moved = to_device([getattr(batch, name) for name in names], device)
    return replace(batch, **dict(zip(names, moved, strict=True)))


def _host_tail_batch(plans: Sequence[RequestPlan], P: int, in_place: bool) -> TailBatch:
    """`_device_tail_batch` on the CPU in numpy: the same tables, bit for bit
    (tests/unit/test_tail_batch.py compares them on random batches)."""
    counts = np.array([p.tail_pages.numel() for p in plans], dtype=np.int64)
    M, B = int(counts.sum()), len(plans)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # each request's m0
    req = np.repeat(np.arange(B, dtype=np.int64), counts)

    def per_request(values: Sequence[int]) -> np.ndarray:  # [M] the page's request's value
        return np.repeat(np.array(values, dtype=np.int64), counts)

    def ranges(lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:  # m0 + [lo, hi) per request
        return _concat([np.arange(m0 + a, m0 + b, dtype=np.int64)
                        for m0, a, b in zip(first.tolist(), lo, hi, strict=True)], np.int64)

    # 1. Token sources [M, P]: staged (position < prefix), fresh (< seq_len) or padding.
    page_start = per_request([p.tail_start for p in plans]) + P * (np.arange(M) - first[req])
    pos = page_start[:, None] + np.arange(P)
    prefix = per_request([p.prefix for p in plans])[:, None]
    fresh = (pos >= prefix) & (pos < per_request([p.seq_len for p in plans])[:, None])
    staged = pos < prefix
    # 2. Staging pages held before / kept after, scattered to their page slots.
    prior_index = ranges([0] * B, [p.prior_stages.numel() for p in plans])
    prior_stage = np.zeros(M, dtype=np.int64)
    prior_stage[prior_index] = _concat([p.prior_stages.cpu().numpy() for p in plans], np.int64)
    has_prior = np.zeros(M, dtype=bool)
    has_prior[prior_index] = True
    # 3. Each page's window queries (`window_tables`), and which of its tokens they saw.
    w = np.array([p.obs_queries for p in plans], dtype=np.int64)[:, None]
    j = np.arange(max((p.obs_queries for p in plans), default=1))
    valid = j[None, :] < w
    last = np.array([p.q_start + p.q_len for p in plans], dtype=np.int64)[:, None]
    end = np.array([p.seq_len for p in plans], dtype=np.int64)[:, None]
    page_win_pos, page_win_valid = (end - w + j)[req], valid[req]  # [M, w]
    new_row = np.where(fresh, per_request([p.q_start for p in plans])[:, None] + pos - prefix, 0)
    slot = np.arange(M * P, dtype=np.int64).reshape(M, P)
    seal_index = ranges([0] * B, [p.num_seal for p in plans])
    stay_index = ranges([p.num_seal for p in plans], counts.tolist())
    stay_stage = _concat([p.after_stages.cpu().numpy() for p in plans], np.int64)
    tensors = {
        "page_req": req, "page_start": page_start, "prior_stage": prior_stage,
        "has_prior": has_prior, "staged": staged, "fresh": fresh, "new_row": new_row,
        "source_row": np.where(staged, slot, np.where(fresh, 1 + new_row, 0)),
        "obs": _concat([pad_to_pages(p.tail_obs.cpu(), P).numpy() for p in plans],
                       np.float32).reshape(-1, P),
        "page_win_row": np.where(valid, last - w + j, 0)[req],
        "page_sees": (pos[:, None, :] <= page_win_pos[:, :, None]) & page_win_valid[..., None],
        "page_saw": (page_win_valid & (page_win_pos >= page_start[:, None])).astype(np.float32),
        "page_win_pos": np.where(page_win_valid, page_win_pos, -1),
        "n_staged": staged.sum(1, dtype=np.int64),
        "held_stage": np.where(has_prior, prior_stage, -1),
        "seal_index": seal_index,
        "seal_pages": _concat([p.tail_pages[: p.num_seal].cpu().numpy() for p in plans], np.int64),
        "stay_index": stay_index, "stay_stage": stay_stage,
    }
    if in_place:  # `_with_in_place`'s tables, where the forward allows them
        kept = has_prior[stay_index]
        if staged[seal_index].all() and np.array_equal(stay_stage[kept],
                                                       prior_stage[stay_index][kept]):
            stages = prior_stage.copy()
            stages[stay_index] = stay_stage
            written = fresh | (~staged & ~has_prior[:, None])  # fresh, new padding
            tensors |= {"page_stage": stages,
                        "write_slot": (stages[:, None] * P + np.arange(P))[written],
                        "write_row": np.where(fresh, new_row, -1)[written],
                        "page_rows": (staged | fresh).sum(1, dtype=np.int64)}
        else:
            in_place = False
    return TailBatch(**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
                     num_seal=len(seal_index), num_stay=len(stay_index), in_place=in_place)


def _concat(parts: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


def _device_tail_batch(plans: Sequence[RequestPlan], P: int, device: torch.device,
                       in_place: bool) -> TailBatch:
    """Host lists per page, then a few device ops."""
    # 1. Per page (host): request, first position, and the request's extents.
    req, start, prefix, seq_len, q_start, seal, stay, prior = ([] for _ in range(8))
    for b, p in enumerate(plans):
        m0, n_pages = len(req), p.tail_pages.numel()
        req += [b] * n_pages
        start += [p.tail_start + P * i for i in range(n_pages)]
        prefix += [p.prefix] * n_pages
        seq_len += [p.seq_len] * n_pages
        q_start += [p.q_start] * n_pages
        prior += range(m0, m0 + p.prior_stages.numel())
        seal += range(m0, m0 + p.num_seal)
        stay += range(m0 + p.num_seal, m0 + n_pages)

    def longs(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    # 2. Token sources [M, P]: staged (position < prefix), fresh (< seq_len) or padding.
    page_start = longs(start)
    pos = page_start[:, None] + torch.arange(P, device=device)
    prefix_t, seq_t = longs(prefix)[:, None], longs(seq_len)[:, None]
    fresh = (pos >= prefix_t) & (pos < seq_t)
    # 3. Staging pages held before / kept after, scattered to their page slots.
    prior_index = longs(prior)
    prior_stage = torch.zeros(len(req), dtype=torch.long, device=device)
    prior_stage[prior_index] = _cat([p.prior_stages for p in plans], device)
    has_prior = torch.zeros(len(req), dtype=torch.bool, device=device)
    has_prior[prior_index] = True
    # 4. Each page's window queries, and which of its tokens they saw.
    win_row, win_pos, win_valid = (t.to(device) for t in window_tables(plans))
    page_req = longs(req)
    page_win_pos = take(win_pos, page_req)  # [M, w]
    page_win_valid = take(win_valid, page_req)
    staged = pos < prefix_t
    new_row = torch.where(fresh, longs(q_start)[:, None] + pos - prefix_t, 0)
    slot = torch.arange(pos.numel(), device=device).view_as(pos)  # m * P + i
    batch = TailBatch(
        page_req=page_req, page_start=page_start, prior_stage=prior_stage,
        has_prior=has_prior, staged=staged, fresh=fresh, new_row=new_row,
        source_row=torch.where(staged, slot, torch.where(fresh, 1 + new_row, 0)),
        obs=_cat([pad_to_pages(p.tail_obs, P) for p in plans], device).view(-1, P),
        page_win_row=take(win_row, page_req),
        page_sees=(pos[:, None, :] <= page_win_pos[:, :, None]) & page_win_valid[..., None],
        page_saw=(page_win_valid & (page_win_pos >= page_start[:, None])).float(),
        page_win_pos=torch.where(page_win_valid, page_win_pos, -1), n_staged=staged.sum(1),
        held_stage=torch.where(has_prior, prior_stage, -1),
        seal_index=longs(seal), seal_pages=_cat([p.tail_pages[: p.num_seal] for p in plans], device),
        stay_index=longs(stay), stay_stage=_cat([p.after_stages for p in plans], device),
        num_seal=len(seal), num_stay=len(stay),
    )
    return _with_in_place(batch, P) if in_place else batch


def _with_in_place(tails: TailBatch, P: int) -> TailBatch:
    """`stage_fresh`'s tables, if every page it seals was wholly staged before and every page
    that stays keeps the staging page it held (else the tails as they are). A page that held
    its staging page before holds zeros past its request's end already (module docstring):
    only its fresh slots are written; a new one's padding is zeroed too."""
    seal, stay = tails.seal_index, tails.stay_index
    if not bool(tails.staged[seal].all()):
        return tails
    kept = tails.has_prior[stay]
    if not torch.equal(tails.stay_stage[kept], tails.prior_stage[stay][kept]):
        return tails
    stages = tails.prior_stage.clone()
    stages[stay] = tails.stay_stage  # [M]
    slots = stages[:, None] * P + torch.arange(P, device=stages.device)  # [M, P]
    written = tails.fresh | (~tails.staged & ~tails.has_prior[:, None])  # fresh, new padding
    rows = torch.where(tails.fresh, tails.new_row, -1)
    return replace(tails, in_place=True, page_stage=stages, write_slot=slots[written],
                   write_row=rows[written], page_rows=(tails.staged | tails.fresh).sum(1))


def _cat(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    parts = [t.to(device) for t in parts]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)



def window_tables(plans: Sequence[RequestPlan]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, w_max] rows, positions and validity of each request's window queries (host)."""
    w_max = max((p.obs_queries for p in plans), default=1)
    j = torch.arange(w_max)
    w = torch.tensor([p.obs_queries for p in plans])[:, None]
    last_row = torch.tensor([p.q_start + p.q_len for p in plans])[:, None]
    end = torch.tensor([p.seq_len for p in plans])[:, None]
    valid = j[None, :] < w
    row = torch.where(valid, last_row - w + j, 0)
    return row, end - w + j, valid


def tail_pages(storage: RaggedStorage, layer: int, tails: TailBatch, k_new: torch.Tensor,
               v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tail page's full K and V, [M, P, H, D] each in k_new's dtype: staged tokens from
    this layer's staging pages, fresh ones from k_new, v_new [N, H, D], zeros past the end."""
    return (_gather(tails, storage.stage_k[layer], k_new),
            _gather(tails, storage.stage_v[layer], v_new))


PageGather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      list[torch.Tensor]]
"""gather_pages(k_stage, v_stage, pages, rows) -> [k, v] [M, P, H, D]: page m is
k_stage[pages[m]]'s first rows[m] tokens, then zeros (cuda_ext/tails.cpp's)."""


def stage_fresh(storage: RaggedStorage, layer: int, tails: TailBatch, k_new: torch.Tensor,
                v_new: torch.Tensor, copy_rows: RowCopy | None = None,
                gather_pages: PageGather | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_pages` of an in-place forward (tails.in_place): this forward's tokens k_new,
    v_new [N, H, D] into their staging slots and zeros past the end of pages new to the
    staging (`RaggedStorage.stage_tokens`; staged tokens are not rewritten), then every tail page's K
    and V [M, P, H, D] read back from this layer's staging pages. `store_tails` with
    kv_staged=True then stores only the statistics. copy_rows: `stage_tokens`' row copy;
    gather_pages: the read-back of each page's rows its request holds (tails.page_rows; the
    native form copies only those, zeros after them), default index_select of whole pages
    (the same values: a staging page holds zeros past its request's end)."""
    if not tails.in_place:
        raise ValueError("stage_fresh needs tail_batch(..., in_place=True) on a forward that "
                         "seals only pages staged before it (tails.in_place is False); use "
                         "tail_pages")
    storage.stage_tokens(layer, tails.write_slot, tails.write_row, k_new, v_new, copy_rows)
    k_stage, v_stage = storage.stage_k[layer], storage.stage_v[layer]
    if gather_pages is not None:
        k_pages, v_pages = gather_pages(k_stage, v_stage, tails.page_stage, tails.page_rows)
        return k_pages, v_pages
    return k_stage.index_select(0, tails.page_stage), v_stage.index_select(0, tails.page_stage)


WindowStats = Callable[[RaggedStorage, int, TailBatch, torch.Tensor, torch.Tensor, torch.Tensor,
                        float], StagedQueryStats]
"""(storage, layer, tails, k_pages, q, lse, scale) -> every tail page's new accumulators."""


def store_tails(storage: RaggedStorage, layer: int, tails: TailBatch, k_pages: torch.Tensor,
                v_pages: torch.Tensor, q: torch.Tensor, lse: torch.Tensor, scale: float,
                stats: WindowStats | None = None, kv_staged: bool = False) -> None:
    """One layer, whole batch: seal the tail pages leaving the window, stage the others.

    k_pages, v_pages: [M, P, H, D] from `tail_pages` (or `stage_fresh`: kv_staged=True, the
    staging pages hold them already); q: [N, H_q, D] this forward's queries; lse: [N, H_q]
    float32 natural-log log-sum-exp of each window query (rows win_row) over all keys it saw,
    sealed rows included (other rows are not read). stats: how the accumulators are computed
    (default `window_stats`; the native path passes its C++ form).
    """
    # 1. What the tail tokens received from the window queries, plus what staged pages held.
    acc = (stats or window_stats)(storage, layer, tails, k_pages, q, lse, scale)
    # 2. Seal the pages leaving the window (scores from their statistics).
    if tails.num_seal:
        s = tails.seal_index
        stats_s = page_stats(_take_stats(acc, s), take(tails.obs, s), take(k_pages, s),
                             take(v_pages, s), scale)
        storage.seal(layer, SealBatch(stats_s, tails.seal_pages, take(tails.page_start, s),
                                      count=tails.num_seal if tails.counted else 0))
    # 3. Stage the rest with their statistics.
    if tails.num_stay:
        s, stages = tails.stay_index, tails.stay_stage
        if not kv_staged:
            storage.stage_kv(layer, stages, take(k_pages, s), take(v_pages, s))
        storage.store_stats(layer, stages, _take_stats(acc, s) if tails.num_seal else acc)


def window_stats(storage: RaggedStorage, layer: int, tails: TailBatch, k_pages: torch.Tensor,
                 q: torch.Tensor, lse: torch.Tensor, scale: float) -> StagedQueryStats:
    """[M] accumulators of the tail pages after this forward (torch): what their tokens
    received from the window queries and the queries' statistics, plus what the staging
    pages they held accumulated before (`store_tails`' arguments)."""
    attn = _window_attention(tails, q, lse, k_pages, scale)  # [M, H, P]
    q_sum, q_sq, q_cnt = _window_query_stats(tails, q, k_pages.shape[2])
    prior = storage.stats.layer(layer, tails.prior_stage)  # [M, ...] (garbage where not held)
    attn += torch.where(tails.staged[:, None, :], prior.attn, 0.0)
    held = tails.has_prior.float()
    q_sum += held[:, None, None] * prior.q_sum
    q_sq += held[:, None, None] * prior.q_sq_sum
    q_cnt += held * prior.q_count
    return StagedQueryStats(attn=attn, q_sum=q_sum, q_sq_sum=q_sq, q_count=q_cnt)


def _take_stats(acc: StagedQueryStats, index: torch.Tensor) -> StagedQueryStats:
    return StagedQueryStats(attn=take(acc.attn, index), q_sum=take(acc.q_sum, index),
                            q_sq_sum=take(acc.q_sq_sum, index), q_count=take(acc.q_count, index))


def _gather(tails: TailBatch, stage: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[M, P, H, D] in new's dtype: staged tokens from stage [S, P, H, D], fresh ones from new
    [N, H, D], zeros past each request's end. One index_select from the table [a zero row,
    new, the tail pages' staging pages]: on a CPU a seventh of the time of selecting by two
    torch.where over [M, P, H, D] (their masks broadcast over H and D)."""
    M, P = tails.source_row.shape
    from_stage = take(stage, tails.prior_stage).to(new.dtype).view(M * P, *new.shape[1:])
    table = torch.cat([new.new_zeros(1, *new.shape[1:]), new, from_stage])
    return take(table, tails.source_row + tails.staged * (1 + new.shape[0]))


def _window_attention(tails: TailBatch, q: torch.Tensor, lse: torch.Tensor,
                      k_pages: torch.Tensor, scale: float) -> torch.Tensor:
    """[M, H, P] float32 attention mass each tail token received from its request's window
    queries, max-reduced over the query heads of each KV head and summed over the queries
    (the reference's `_window_probs` reduction, with the softmax normalizer taken from lse)."""
    M, P, H, D = k_pages.shape
    rows = tails.page_win_row  # [M, w]
    w, h_q = rows.shape[1], q.shape[1]
    q_win = take(q, rows).float().view(M, w, H, h_q // H, D)
    logits = torch.einsum("mwhgd,mphd->mwhgp", q_win, k_pages.float()) * scale
    norm = take(lse, rows).view(M, w, H, h_q // H, 1)
    probs = torch.where(tails.page_sees[:, :, None, None, :], torch.exp(logits - norm), 0.0)
    return probs.amax(3).sum(1)


def _window_query_stats(tails: TailBatch, q: torch.Tensor,
                        num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tail page, this forward's window queries that saw it (position >= the page's first
    position), pooled per KV head: q_sum, q_sq_sum [M, H, D] float32, q_count [M] float32."""
    M, w = tails.page_win_row.shape
    h_q, d = q.shape[1:]
    gsize = h_q // num_kv_heads
    saw = tails.page_saw  # [M, w]
    q_win = torch.where(saw[..., None, None] > 0, take(q, tails.page_win_row).float(), 0.0)
    q_win = q_win.view(M, w, num_kv_heads, gsize, d)
    sums = torch.einsum("mw,mwhgd->mhd", saw, q_win)
    squares = torch.einsum("mw,mwhgd->mhd", saw, q_win.square())
    return sums, squares, saw.sum(1) * gsize
