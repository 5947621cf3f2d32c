"""Batched torch attention (the CPU default): the whole batch per head group, no request loop.

Per layer and group g, every request's keys are its sealed rows followed by its tail pages,
padded to the batch's longest: one gather and one attention call per group instead of one per
(request, group) as in the reference (torch_ref.py, still the oracle). Staging and sealing run
batched too (tail_batch.store_tails, sealed by the storage's `Sealer`).

Padded key index k of request b in group g (k_g slots per sealed page, S sealed pages at most);
query i sees key k iff key_pos[b, k] <= q_pos[b, i]:

    | k                       | key                                      | key_pos                 |
    |-------------------------|------------------------------------------|-------------------------|
    | [0, S * k_g)            | slot k % k_g of page sealed_table[b, k // k_g] | -1 (NEVER if padding) |
    | S * k_g + t, t < Tp * P | token t of the request's tail pages      | tail_pos[b, t]          |
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.ops import query_heads, take
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.attention_backend.tail_batch import (
    TailBatch,
    store_tails,
    tail_batch,
    tail_pages,
    window_tables,
)
from sgl_ragged.mem_pool.storage import RaggedStorage

NEVER = 2**62
"""Position of padded keys: after every query."""

MAX_PADDED = 2**24
"""Padded (query, key) pairs per sub-batch: requests are attended together while
requests x longest query run x longest key run stays below this (one long prefill chunk
beside short ones would otherwise pad every request to its size); decode batches fit whole."""

SINGLE_THREAD_PAIRS = {True: 2**17, False: 2**19}
"""Decode (True) / extend (False) forwards with at most this many (query, logical key) pairs
run their attention on one intra-op thread: their ops are small, and waking the thread pool
for each (OMP_WAIT_POLICY=PASSIVE) costs more than the second core gives. Measured with
bench.cpu_attention on 2 cores: decode of 1-64 requests 1.2-3x faster at <= 70K pairs, 10%
slower at 133K; a 256-token prefill chunk 1.4x faster at 330K, slower from 650K."""


@dataclass(frozen=True)
class PaddedBatch:
    """A run of consecutive requests as padded [B, ...] index tables (built once per forward,
    every layer reads)."""

    q_row: torch.Tensor  # [B, Lq] int64 rows of q/k/v (0 where padded)
    q_rows_valid: torch.Tensor  # [V] int64 q_row at the valid entries (row-major)
    q_flat_valid: torch.Tensor  # [V] int64 positions of those entries in q_row.flatten()
    q_pos: torch.Tensor  # [B, Lq] int64 query positions (-1 where padded)
    win_row: torch.Tensor  # [B, w] int64 rows of the window queries (0 where padded)
    win_rows_valid: torch.Tensor  # [W] int64 win_row at the valid entries
    win_flat_valid: torch.Tensor  # [W] int64 positions of those entries in win_row.flatten()
    win_pos: torch.Tensor  # [B, w] int64 window query positions (-1 where padded)
    sealed_table: torch.Tensor  # [B, S] int64 logical pages of the sealed rows (0 where padded)
    num_sealed: torch.Tensor  # [B] int64 sealed pages per request
    tail_page: torch.Tensor  # [B, Tp] int64 tail page m (TailBatch index; 0 where padded)
    tail_pos: torch.Tensor  # [B, Tp * P] int64 tail token positions (past the end: pad)
    pairs: int  # (query, logical key) pairs of the run's requests, unpadded (host)


def padded_batches(plans: Sequence[RequestPlan], page_size: int, device: torch.device,
                   max_padded: int = MAX_PADDED) -> list[PaddedBatch]:
    """The batch cut into runs of consecutive requests whose padded size stays under
    max_padded (a request alone may exceed it), each as index tables."""
    runs: list[list[int]] = [[]]
    longest_q = longest_k = 0  # of the current run
    for b, p in enumerate(plans):
        keys = (p.sealed_pages.numel() + p.tail_pages.numel()) * page_size  # at most
        if runs[-1] and (len(runs[-1]) + 1) * max(longest_q, p.q_len) * max(longest_k, keys) > max_padded:
            runs.append([])
            longest_q = longest_k = 0
        runs[-1].append(b)
        longest_q, longest_k = max(longest_q, p.q_len), max(longest_k, keys)
    first_page = [0]
    for p in plans:
        first_page.append(first_page[-1] + p.tail_pages.numel())
    return [padded_batch([plans[b] for b in run], [first_page[b] for b in run], page_size, device)
            for run in runs]


def padded_batch(plans: Sequence[RequestPlan], first_page: Sequence[int], page_size: int,
                 device: torch.device) -> PaddedBatch:
    """Index tables for these plans (host lists, one copy per table); first_page[b] is the
    TailBatch index of request b's first tail page."""
    q_len = max(p.q_len for p in plans)
    n_sealed = max(1, max(p.sealed_pages.numel() for p in plans))
    n_tail = max(p.tail_pages.numel() for p in plans)
    q_row, q_pos, sealed, tail = [], [], [], []
    for p, m0 in zip(plans, first_page, strict=True):
        pad = q_len - p.q_len
        q_row.append(list(range(p.q_start, p.q_start + p.q_len)) + [0] * pad)
        q_pos.append(list(range(p.prefix, p.seq_len)) + [-1] * pad)
        pages = p.sealed_pages.tolist()
        sealed.append(pages + [0] * (n_sealed - len(pages)))
        count = p.tail_pages.numel()
        tail.append(list(range(m0, m0 + count)) + [0] * (n_tail - count))
    # Tail token positions (past a request's end: never <= any of its query positions).
    tail_pos = torch.tensor([p.tail_start for p in plans])[:, None] + torch.arange(n_tail * page_size)
    q_row_t, q_pos_t = torch.tensor(q_row), torch.tensor(q_pos)
    win_row, win_pos, win_valid = window_tables(plans)
    q_valid, w_valid = (q_pos_t >= 0).flatten().nonzero().flatten(), win_valid.flatten().nonzero().flatten()

    def dev(x: object) -> torch.Tensor:
        return torch.as_tensor(x, device=device)

    return PaddedBatch(
        q_row=dev(q_row_t), q_rows_valid=dev(q_row_t.flatten()[q_valid]), q_flat_valid=dev(q_valid),
        q_pos=dev(q_pos_t), win_row=dev(win_row), win_rows_valid=dev(win_row.flatten()[w_valid]),
        win_flat_valid=dev(w_valid), win_pos=dev(torch.where(win_valid, win_pos, -1)),
        sealed_table=dev(sealed), num_sealed=dev([p.sealed_pages.numel() for p in plans]),
        tail_page=dev(tail), tail_pos=dev(tail_pos),
        pairs=sum(p.q_len * (p.sealed_pages.numel() + p.tail_pages.numel()) * page_size
                  for p in plans),
    )


@dataclass(frozen=True)
class BatchedTorchBatch:
    """What `BatchedTorchAttention.prepare` builds once per forward."""

    tails: TailBatch  # the batch's tail pages (staging and sealing)
    padded: list[PaddedBatch]  # padded runs of consecutive requests (attention)


class BatchedTorchAttention(AttentionImpl[BatchedTorchBatch]):
    """Ragged attention in torch, batched over requests (one call per head group)."""

    def __init__(self, storage: RaggedStorage, max_padded: int = MAX_PADDED) -> None:
        super().__init__(storage)
        self.max_padded = max_padded

    def prepare(self, plan: BatchPlan) -> BatchedTorchBatch:
        assert plan.staged, "planner.take_staging did not run for this plan"
        P, device = self.storage.layout.page_size, self.storage.device
        return BatchedTorchBatch(tails=tail_batch(plan.requests, P, device),
                                 padded=padded_batches(plan.requests, P, device, self.max_padded))

    def forward(self, layer: int, batch: BatchedTorchBatch, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        small = sum(pb.pairs for pb in batch.padded) <= SINGLE_THREAD_PAIRS[decode]
        with _intra_op_threads(1 if small else torch.get_num_threads()):
            return self._forward(layer, batch, q, k, v, scale, decode)

    def _forward(self, layer: int, batch: BatchedTorchBatch, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        tails = batch.tails
        k_pages, v_pages = tail_pages(self.storage, layer, tails, k, v)  # [M, P, H, D]
        out = torch.empty_like(q)
        lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)  # window rows only
        for pb in batch.padded:
            # 1. Attention per group over the run's padded requests.
            out_pad, lse_pad = self._attend(layer, pb, q, k_pages, v_pages, scale, decode)
            # 2. Back to q's rows: every query's output, the window queries' log-sum-exps.
            out.index_copy_(0, pb.q_rows_valid, take(out_pad.flatten(0, 1), pb.q_flat_valid))
            lse.index_copy_(0, pb.win_rows_valid, take(lse_pad.flatten(0, 1), pb.win_flat_valid))
        # 3. Seal what leaves the window, stage the rest.
        store_tails(self.storage, layer, tails, k_pages, v_pages, q, lse, scale,
                    self.storage.sealer)
        return out

    def _attend(self, layer: int, pb: PaddedBatch, q: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, scale: float, decode: bool,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, Lq, H_q, D] of every (padded) query and lse [B, w, H_q] float32 of the
        window queries; padded entries hold garbage."""
        tail_k = take(k_pages, pb.tail_page).flatten(1, 2)  # [B, Tp * P, H, D]
        tail_v = take(v_pages, pb.tail_page).flatten(1, 2)
        q_pad = take(q, pb.q_row)  # [B, Lq, H_q, D]
        q_win = take(q, pb.win_row)  # [B, w, H_q, D]
        out_pad = torch.empty_like(q_pad)
        lse_pad = torch.zeros(q_win.shape[:3], dtype=torch.float32, device=q.device)
        gsize = q.shape[1] // k_pages.shape[2]
        for g, heads in enumerate(self.storage.head_index[layer]):
            keys, values, key_pos = self._group_keys(layer, g, heads, tail_k, tail_v, pb)
            qh = query_heads(heads, gsize)
            q_g = q_pad.index_select(2, qh)  # [B, Lq, Hq_g, D]
            mask = key_pos[:, None, :] <= pb.q_pos[:, :, None]  # [B, Lq, L]
            if decode:  # the one query per request is its window
                out_g, lse_g = _explicit_attention(q_g, keys, values, mask, scale)
            else:
                out_g = _sdpa(q_g, keys, values, mask, scale)
                logits = _logits(q_win.index_select(2, qh), keys,
                                 key_pos[:, None, :] <= pb.win_pos[:, :, None], scale)
                lse_g = torch.logsumexp(logits, -1).flatten(2)  # [B, w, Hq_g]
            out_pad.index_copy_(2, qh, out_g)
            lse_pad.index_copy_(2, qh, lse_g)
        return out_pad, lse_pad

    def _group_keys(self, layer: int, g: int, heads: torch.Tensor, tail_k: torch.Tensor,
                    tail_v: torch.Tensor, pb: PaddedBatch,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values [B, L, H_p, D] of group g (sealed rows, then the tail [B, Tp * P, H,
        D] of its heads) and each key's position for the causal mask, [B, L] int64: -1 for
        sealed keys (every query sees them), NEVER for padding."""
        st = self.storage
        k_g = st.layout.slots[layer][g]
        B, S = pb.sealed_table.shape
        sealed_k, sealed_v = st.page_kv(layer, g, pb.sealed_table)  # [B, S, k_g, H_p, D]
        sealed_k = sealed_k.view(B, S * k_g, len(heads), -1)
        sealed_v = sealed_v.view(B, S * k_g, len(heads), -1)
        group_k = tail_k.index_select(2, heads).to(sealed_k.dtype)
        group_v = tail_v.index_select(2, heads).to(sealed_v.dtype)
        exists = torch.arange(S * k_g, device=st.device)[None, :] < pb.num_sealed[:, None] * k_g
        key_pos = torch.cat([torch.where(exists, -1, NEVER), pb.tail_pos], 1)
        return torch.cat([sealed_k, group_k], 1), torch.cat([sealed_v, group_v], 1), key_pos


@contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n inside the block (restored after)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _logits(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Lq, Hq_g, D], keys [B, L, H_p, D], mask [B, Lq, L] -> float32 logits
    [B, Lq, H_p, G, L], -inf where masked."""
    B, Lq, h_q, D = q.shape
    h_p = keys.shape[2]
    grouped = q.float().view(B, Lq, h_p, h_q // h_p, D)
    logits = torch.einsum("bqhgd,bnhd->bqhgn", grouped, keys.float()) * scale
    return logits.masked_fill(~mask[:, :, None, None, :], float("-inf"))


def _explicit_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out (decode: one query per request), with its log-sum-exp.
    Returns out [B, Lq, Hq_g, D] in q's dtype and lse [B, Lq, Hq_g] float32."""
    logits = _logits(q, keys, mask, scale)
    lse = torch.logsumexp(logits, -1)  # [B, Lq, H_p, G]
    probs = torch.exp(logits - lse[..., None]).nan_to_num_(0.0)  # padded queries see nothing
    out = torch.einsum("bqhgn,bnhd->bqhgd", probs, values.float())
    return out.flatten(2, 3).to(q.dtype), lse.flatten(2)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
          scale: float) -> torch.Tensor:
    """Batched SDPA: q [B, Lq, Hq_g, D], keys/values [B, L, H_p, D], mask [B, Lq, L]."""
    out = scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)
