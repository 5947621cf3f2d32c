"""Torch reference of ragged attention: the oracle for every other implementation.

Per request and head group, the keys are the group's sealed rows followed by the full tail
(staged tokens, then this forward's tokens), all post-RoPE, so no positions are needed except
for the causal mask inside the tail. Groups attend independently: every query head reads only
its own KV head, so there is nothing to merge across groups.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.ops import query_heads
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.mem_pool.sealer import SealBatch
from sgl_ragged.mem_pool.staging_stats import StagedQueryStats, page_stats
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.scoring import page_query_stats


class TorchAttention(AttentionImpl[BatchPlan]):
    """The torch reference, request by request (`request_forward`); reads the plan itself."""

    def prepare(self, plan: BatchPlan) -> BatchPlan:
        assert plan.staged, "planner.take_staging did not run for this plan"
        return plan

    def forward(self, layer: int, batch: BatchPlan, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        out = torch.empty_like(q)
        for plan in batch.requests:
            rows = slice(plan.q_start, plan.q_start + plan.q_len)
            out[rows] = request_forward(self.storage, layer, plan, q[rows], k[rows], v[rows], scale)
        return out


def on_device(plan: RequestPlan, device: torch.device) -> RequestPlan:
    """The plan with the tensors the reference indexes the storage with on its device (the
    planner builds them on the host)."""
    return replace(plan, sealed_pages=plan.sealed_pages.to(device),
                   prior_stages=plan.prior_stages.to(device),
                   after_stages=plan.after_stages.to(device), tail_obs=plan.tail_obs.to(device))


def request_forward(
    storage: RaggedStorage,
    layer: int,
    plan: RequestPlan,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One request, one layer: attention output, then staging and sealing of its tail.

    q: [q_len, H_q, D]; k_new, v_new: [q_len, H, D] this forward's tokens.
    Returns [q_len, H_q, D] in q's dtype.
    """
    plan = on_device(plan, storage.device)
    # 1. The full tail: staged tokens before this forward, then the new ones.
    tail_k, tail_v = tail_kv(storage, layer, plan, k_new, v_new)  # [T, H, D]
    h_q, h_kv = q.shape[1], tail_k.shape[1]
    gsize = h_q // h_kv
    out = torch.empty_like(q)
    # tail_attn: [H, T] float32 attention mass the tail received from this forward's window.
    tail_attn = torch.zeros(h_kv, plan.tail_len, device=q.device)
    mask = _tail_mask(plan, q.device)
    for g, heads in enumerate(storage.head_index[layer]):
        qh = query_heads(heads, gsize)
        sealed_k, sealed_v = storage.sealed_kv(layer, g, plan.sealed_pages)  # [N_s, H_p, D]
        keys = torch.cat([sealed_k, tail_k[:, heads].to(sealed_k.dtype)])
        values = torch.cat([sealed_v, tail_v[:, heads].to(sealed_v.dtype)])
        full_mask = _with_sealed(mask, sealed_k.shape[0])
        keep = storage.sealed_keep(layer, g, plan.sealed_pages)  # dynamic mode: [N_s, H_p]
        if keep is not None:
            full_mask = _per_head_mask(full_mask, keep, gsize, plan.q_len, keys.shape[0])
        out[:, qh] = _sdpa(q[:, qh], keys, values, full_mask, scale)
        probs = _window_probs(q[-plan.obs_queries :, qh], keys, full_mask, scale, plan.obs_queries)
        tail_attn[heads] = probs[:, :, sealed_k.shape[0] :].view(
            plan.obs_queries, heads.numel(), gsize, -1).amax(2).sum(0)
    # 2. Compress pages that leave the window; keep the rest staged.
    store_tail(storage, layer, plan, tail_k, tail_v, tail_attn, q[-plan.obs_queries :], scale)
    return out


def tail_kv(
    storage: RaggedStorage, layer: int, plan: RequestPlan, k_new: torch.Tensor, v_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    staged = plan.prefix - plan.tail_start
    if staged == 0:
        return k_new, v_new
    old_k, old_v = storage.staged_kv(layer, plan.prior_stages)
    return (torch.cat([old_k[:staged].to(k_new.dtype), k_new]),
            torch.cat([old_v[:staged].to(v_new.dtype), v_new]))


def _tail_mask(plan: RequestPlan, device: torch.device) -> torch.Tensor | None:
    """[q_len, T] bool causal mask over the tail, or None for a single query (decode)."""
    if plan.q_len == 1:
        return None
    q_pos = torch.arange(plan.prefix, plan.seq_len, device=device)
    k_pos = torch.arange(plan.tail_start, plan.seq_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def _with_sealed(mask: torch.Tensor | None, num_sealed: int) -> torch.Tensor | None:
    if mask is None or num_sealed == 0:
        return mask
    visible = torch.ones(mask.shape[0], num_sealed, dtype=torch.bool, device=mask.device)
    return torch.cat([visible, mask], dim=1)


def _per_head_mask(mask: torch.Tensor | None, keep: torch.Tensor, gsize: int, q_len: int,
                   n_keys: int) -> torch.Tensor:
    """Dynamic mode: [Hq_g, Lq, N] bool, the shared mask [Lq, N] (None = all visible) with each
    head's dropped sealed tokens (keep [N_s, H_p] False) hidden from its query heads."""
    if mask is None:
        mask = torch.ones(q_len, n_keys, dtype=torch.bool, device=keep.device)
    head_mask = mask.expand(keep.shape[1] * gsize, -1, -1).clone()
    n_sealed = keep.shape[0]
    head_mask[:, :, :n_sealed] &= keep.T.repeat_interleave(gsize, dim=0)[:, None, :]
    return head_mask


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """q: [Lq, Hq, D]; k, v: [N, H_p, D]; mask [Lq, N], [Hq, Lq, N] or None. Returns [Lq, Hq, D]."""
    out = scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.to(q.dtype).transpose(0, 1).unsqueeze(0),
        v.to(q.dtype).transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _window_probs(q_win: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  w: int) -> torch.Tensor:
    """Softmax probabilities of the window queries: [w, Hq, N] float32."""
    gsize = q_win.shape[1] // k.shape[1]
    k_rep = k.float().repeat_interleave(gsize, dim=1)
    logits = torch.einsum("qhd,nhd->qhn", q_win.float(), k_rep) * scale
    if mask is not None and mask.dim() == 3:  # per query head: [Hq, Lq, N]
        logits.masked_fill_(~mask[:, -w:].transpose(0, 1), float("-inf"))
    elif mask is not None:
        logits.masked_fill_(~mask[-w:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)


def store_tail(
    storage: RaggedStorage, layer: int, plan: RequestPlan, tail_k: torch.Tensor,
    tail_v: torch.Tensor, tail_attn: torch.Tensor, q_win: torch.Tensor, scale: float,
) -> None:
    """Seal the first `num_seal` tail pages, write the rest into their staging pages.

    q_win: [w, H_q, D] this forward's window queries (the last w of the forward).
    """
    P = storage.layout.page_size
    T = plan.tail_len
    # Attention mass accumulated while staged, plus this forward's.
    staged = plan.prefix - plan.tail_start
    if staged:
        tail_attn[:, :staged] += storage.stats.attn[plan.prior_stages, layer].transpose(0, 1).flatten(1)[:, :staged]
    n_pages = plan.tail_pages.numel()
    q_sum, q_sq, q_cnt = _page_query_stats(storage, layer, plan, q_win, n_pages)
    pad = n_pages * P - T
    k_pages = _pad_pages(tail_k, pad, P)  # [n_pages, P, H, D]
    v_pages = _pad_pages(tail_v, pad, P)
    attn_pages = torch.nn.functional.pad(tail_attn, (0, pad)).view(-1, n_pages, P).transpose(0, 1)
    obs_pages = torch.nn.functional.pad(plan.tail_obs, (0, pad)).view(n_pages, P)
    n = plan.num_seal
    if n:
        pages = plan.tail_pages[:n].to(storage.device)
        start = plan.tail_start + P * torch.arange(n, device=storage.device)
        acc = StagedQueryStats(attn=attn_pages[:n], q_sum=q_sum[:n], q_sq_sum=q_sq[:n],
                               q_count=q_cnt[:n])
        stats = page_stats(acc, obs_pages[:n], k_pages[:n], v_pages[:n], scale)
        storage.seal(layer, SealBatch(stats, pages, start, count=n))
    if n < n_pages:
        stages = plan.after_stages
        storage.stage_kv(layer, stages, k_pages[n:], v_pages[n:])
        storage.store_stats(layer, stages, StagedQueryStats(
            attn=attn_pages[n:], q_sum=q_sum[n:], q_sq_sum=q_sq[n:], q_count=q_cnt[n:]))


def _page_query_stats(
    storage: RaggedStorage, layer: int, plan: RequestPlan, q_win: torch.Tensor, n_pages: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tail page: the statistics of this forward's window queries that saw it (query
    position >= the page's first position), pooled per KV head, plus what its staging page held.

    q_win: [w, H_q, D]. Returns q_sum, q_sq_sum [n_pages, H, D] float32, q_count [n_pages] float32.
    """
    P, w = storage.layout.page_size, q_win.shape[0]
    q_pos = torch.arange(plan.seq_len - w, plan.seq_len, device=q_win.device)
    page_start = plan.tail_start + P * torch.arange(n_pages, device=q_win.device)
    sums, squares, counts = page_query_stats(q_win, q_pos, page_start, storage.layout.num_kv_heads)
    held = plan.prior_stages.numel()  # the tail's first pages were staged before
    if held:
        prior = storage.stats.layer(layer, plan.prior_stages)
        sums[:held] += prior.q_sum
        squares[:held] += prior.q_sq_sum
        counts[:held] += prior.q_count
    return sums, squares, counts


def _pad_pages(x: torch.Tensor, pad: int, P: int) -> torch.Tensor:
    """[T, H, D] -> [ceil(T / P), P, H, D], zero-padded at the end."""
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.view(-1, P, *x.shape[1:])
