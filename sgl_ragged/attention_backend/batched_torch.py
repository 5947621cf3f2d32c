"""Batched torch attention (the CPU default): the whole batch per head group, no request loop.

Per layer and group g, every request's keys are its sealed rows followed by its tail pages,
padded to the batch's longest: one gather and one attention call per group instead of one per
(request, group) as in the reference (torch_ref.py, still the oracle). Staging and sealing run
batched too (tail_batch.store_tails, sealed by `RaggedStorage.write_rows`).

Padded key index k of request b in group g (k_g slots per sealed page, S sealed pages at most);
query i sees key k iff key_pos[b, k] <= q_pos[b, i]:

    | k                       | key                                      | key_pos                 |
    |-------------------------|------------------------------------------|-------------------------|
    | [0, S * k_g)            | slot k % k_g of page sealed_table[b, k // k_g] | -1 (NEVER if padding) |
    | S * k_g + t, t < Tp * P | token t of the request's tail pages      | tail_pos[b, t]          |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata, RequestPlan
from sgl_ragged.attention_backend.tail_batch import (
    TailBatch,
    store_tails,
    tail_batch,
    tail_pages,
    take,
    write_rows_sealer,
)
from sgl_ragged.attention_backend.torch_ref import query_heads
from sgl_ragged.mem_pool.storage import RaggedStorage

NEVER = 2**62
"""Position of padded keys: after every query."""


@dataclass(frozen=True)
class PaddedBatch:
    """The batch as padded [B, ...] index tables (built once per forward, every layer reads)."""

    q_row: torch.Tensor  # [B, Lq] int64 rows of q/k/v (0 where padded)
    q_rows_valid: torch.Tensor  # [V] int64 q_row at the valid entries (row-major)
    q_flat_valid: torch.Tensor  # [V] int64 positions of those entries in q_row.flatten()
    sealed_table: torch.Tensor  # [B, S] int64 logical pages of the sealed rows (0 where padded)
    num_sealed: torch.Tensor  # [B] int64 sealed pages per request
    tail_page: torch.Tensor  # [B, Tp] int64 tail page m (TailBatch index; 0 where padded)
    q_pos: torch.Tensor  # [B, Lq] int64 query positions (-1 where padded)
    win_pos: torch.Tensor  # [B, w_max] int64 window query positions (-1 where padded)
    tail_pos: torch.Tensor  # [B, Tp * P] int64 tail token positions (past the end: pad)


def padded_batch(plans: list[RequestPlan], tails: TailBatch, page_size: int,
                 device: torch.device) -> PaddedBatch:
    """Index tables for these plans (host lists, one copy per table)."""
    q_len = max(p.q_len for p in plans)
    n_sealed = max(1, max(p.sealed_pages.numel() for p in plans))
    n_tail, m0 = max(p.tail_pages.numel() for p in plans), 0
    q_row, q_pos, sealed, tail = [], [], [], []
    for p in plans:
        pad = q_len - p.q_len
        q_row.append(list(range(p.q_start, p.q_start + p.q_len)) + [0] * pad)
        q_pos.append(list(range(p.prefix, p.seq_len)) + [-1] * pad)
        pages = p.sealed_pages.tolist()
        sealed.append(pages + [0] * (n_sealed - len(pages)))
        count = p.tail_pages.numel()
        tail.append(list(range(m0, m0 + count)) + [0] * (n_tail - count))
        m0 += count
    # Tail token positions (past a request's end: never <= any of its query positions).
    tail_pos = torch.tensor([p.tail_start for p in plans])[:, None] + torch.arange(n_tail * page_size)
    q_pos_t, q_row_t = torch.tensor(q_pos), torch.tensor(q_row)
    flat_valid = (q_pos_t >= 0).flatten().nonzero().flatten()
    return PaddedBatch(
        q_row=q_row_t.to(device), q_rows_valid=q_row_t.flatten()[flat_valid].to(device),
        q_flat_valid=flat_valid.to(device), sealed_table=torch.tensor(sealed, device=device),
        num_sealed=torch.tensor([p.sealed_pages.numel() for p in plans], device=device),
        tail_page=torch.tensor(tail, device=device),
        q_pos=q_pos_t.to(device), win_pos=torch.where(tails.win_valid, tails.win_pos, -1),
        tail_pos=tail_pos.to(device),
    )


class BatchedTorchAttention(AttentionImpl):
    """Ragged attention in torch, batched over requests (one call per head group)."""

    def __init__(self, storage: RaggedStorage) -> None:
        super().__init__(storage)
        self.seal = write_rows_sealer(storage)

    def prepare(self, meta: RaggedForwardMetadata) -> None:
        P, device = self.storage.layout.page_size, self.storage.device
        meta.tails = tail_batch(meta.requests, P, device)
        meta.padded = padded_batch(meta.requests, meta.tails, P, device)

    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        tails, pb = meta.tails, meta.padded
        assert tails is not None and pb is not None, "prepare() did not run for this forward"
        # 1. Attention per group over padded requests.
        k_pages, v_pages = tail_pages(self.storage, layer, tails, k, v)  # [M, P, H, D]
        out_pad, lse_pad = self._attend(layer, tails, pb, q, k_pages, v_pages, scale, decode)
        # 2. Back to q's rows: outputs of every query, log-sum-exps of the window queries.
        out = torch.empty_like(q)
        out.index_copy_(0, pb.q_rows_valid, take(out_pad.flatten(0, 1), pb.q_flat_valid))
        lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
        lse.index_copy_(0, tails.win_rows_valid, take(lse_pad.flatten(0, 1), tails.win_flat_valid))
        # 3. Seal what leaves the window, stage the rest.
        store_tails(self.storage, layer, tails, k_pages, v_pages, q, lse, scale, self.seal)
        return out

    def _attend(self, layer: int, tails: TailBatch, pb: PaddedBatch, q: torch.Tensor,
                k_pages: torch.Tensor, v_pages: torch.Tensor, scale: float, decode: bool,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, Lq, H_q, D] of every (padded) query and lse [B, w, H_q] float32 of the
        window queries; padded entries hold garbage."""
        tail_k = take(k_pages, pb.tail_page).flatten(1, 2)  # [B, Tp * P, H, D]
        tail_v = take(v_pages, pb.tail_page).flatten(1, 2)
        q_pad = take(q, pb.q_row)  # [B, Lq, H_q, D]
        q_win = take(q, tails.win_row)  # [B, w, H_q, D]
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
        sealed_k = take(st.rows_k[layer][g], pb.sealed_table).view(B, S * k_g, len(heads), -1)
        sealed_v = take(st.rows_v[layer][g], pb.sealed_table).view(B, S * k_g, len(heads), -1)
        group_k = tail_k.index_select(2, heads).to(sealed_k.dtype)
        group_v = tail_v.index_select(2, heads).to(sealed_v.dtype)
        exists = torch.arange(S * k_g, device=st.device)[None, :] < pb.num_sealed[:, None] * k_g
        key_pos = torch.cat([torch.where(exists, -1, NEVER), pb.tail_pos], 1)
        return torch.cat([sealed_k, group_k], 1), torch.cat([sealed_v, group_v], 1), key_pos


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
