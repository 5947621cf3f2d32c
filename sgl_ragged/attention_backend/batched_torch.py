"""Batched torch attention (the CPU default): the whole batch per head group, no request loop.

Per layer and group g, every request's keys are its sealed rows followed by its tail pages,
padded to the batch's longest: one gather and one attention call per group instead of one per
(request, group) as in the reference (torch_ref.py, still the oracle). Staging and sealing run
batched too (tail_batch.store_tails, sealed by `RaggedStorage.write_rows`).

Padded key index k of request b in group g (k_g slots per sealed page, S sealed pages at most):

    | k                         | key                                   | visible to query i     |
    |---------------------------|---------------------------------------|------------------------|
    | [0, S * k_g)              | slot k % k_g of page sealed[b, k//k_g] | k < num_sealed[b] * k_g |
    | S * k_g + t, t < Tp * P   | token t of the request's tail pages   | tail_pos[b, t] <= q_pos |
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
    write_rows_sealer,
)
from sgl_ragged.attention_backend.torch_ref import query_heads


@dataclass(frozen=True)
class PaddedBatch:
    """The batch as padded [B, ...] index tables (built once per forward, every layer reads)."""

    q_row: torch.Tensor  # [B, Lq] int64 rows of q/k/v (0 where padded)
    q_pos: torch.Tensor  # [B, Lq] int64 positions (-1 where padded: sees nothing)
    q_valid: torch.Tensor  # [B, Lq] bool
    sealed_table: torch.Tensor  # [B, S] int64 logical pages of the sealed rows (0 where padded)
    num_sealed: torch.Tensor  # [B] int64 sealed pages per request
    tail_page: torch.Tensor  # [B, Tp] int64 tail page m (TailBatch index; 0 where padded)
    tail_pos: torch.Tensor  # [B, Tp * P] int64 position of each tail token (past the end: pad)


def padded_batch(plans: list[RequestPlan], page_size: int, device: torch.device) -> PaddedBatch:
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
    starts = torch.tensor([p.tail_start for p in plans])
    tail_pos = starts[:, None] + torch.arange(n_tail * page_size)
    q_pos_t = torch.tensor(q_pos)
    return PaddedBatch(
        q_row=torch.tensor(q_row, device=device), q_pos=q_pos_t.to(device),
        q_valid=(q_pos_t >= 0).to(device), sealed_table=torch.tensor(sealed, device=device),
        num_sealed=torch.tensor([p.sealed_pages.numel() for p in plans], device=device),
        tail_page=torch.tensor(tail, device=device), tail_pos=tail_pos.to(device),
    )


class BatchedTorchAttention(AttentionImpl):
    """Ragged attention in torch, batched over requests (one call per head group)."""

    def prepare(self, meta: RaggedForwardMetadata) -> None:
        P, device = self.storage.layout.page_size, self.storage.device
        meta.tails = tail_batch(meta.requests, P, device)
        meta.padded = padded_batch(meta.requests, P, device)

    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        tails, pb = meta.tails, meta.padded
        assert tails is not None and pb is not None, "prepare() did not run for this forward"
        k_pages, v_pages = tail_pages(self.storage, layer, tails, k, v)  # [M, P, H, D]
        out = torch.empty_like(q)
        lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)  # window rows only
        gsize = q.shape[1] // k.shape[1]
        for g, heads in enumerate(self.storage.head_index[layer]):
            keys, values, visible_sealed = self._group_keys(layer, g, heads, pb, k_pages, v_pages)
            qh = query_heads(heads, gsize)
            # 1. Outputs of every query; 2. log-sum-exps of the window queries (the scorer's).
            rows = q[:, qh][pb.q_row]  # [B, Lq, Hq_g, D]
            mask = self._mask(visible_sealed, pb.tail_pos, pb.q_pos)  # [B, Lq, L]
            if decode:
                out_g, lse_g = _explicit_attention(rows, keys, values, mask, scale)
                lse[pb.q_row[pb.q_valid][:, None], qh] = lse_g[pb.q_valid]
            else:
                out_g = _sdpa(rows, keys, values, mask, scale)
                self._window_lse(lse, q, qh, tails, keys, visible_sealed, pb.tail_pos, scale)
            out[pb.q_row[pb.q_valid][:, None], qh] = out_g[pb.q_valid]
        store_tails(self.storage, layer, tails, k_pages, v_pages, q, lse, scale,
                    write_rows_sealer(self.storage))
        return out

    def _group_keys(self, layer: int, g: int, heads: torch.Tensor, pb: PaddedBatch,
                    k_pages: torch.Tensor, v_pages: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values [B, L, H_p, D] of group g (sealed rows, then the tail), and which
        sealed keys exist: [B, S * k_g] bool."""
        st = self.storage
        k_g = st.layout.slots[layer][g]
        B, S = pb.sealed_table.shape
        sealed_k = st.rows_k[layer][g][pb.sealed_table].view(B, S * k_g, len(heads), -1)
        sealed_v = st.rows_v[layer][g][pb.sealed_table].view(B, S * k_g, len(heads), -1)
        tail_k = k_pages[pb.tail_page][..., heads, :].flatten(1, 2).to(sealed_k.dtype)
        tail_v = v_pages[pb.tail_page][..., heads, :].flatten(1, 2).to(sealed_v.dtype)
        exists = torch.arange(S * k_g, device=st.device)[None, :] < pb.num_sealed[:, None] * k_g
        return torch.cat([sealed_k, tail_k], 1), torch.cat([sealed_v, tail_v], 1), exists

    @staticmethod
    def _mask(visible_sealed: torch.Tensor, tail_pos: torch.Tensor,
              q_pos: torch.Tensor) -> torch.Tensor:
        """[B, Lq, L] bool: every existing sealed key, tail keys causally."""
        causal = tail_pos[:, None, :] <= q_pos[:, :, None]  # [B, Lq, Tp * P]
        return torch.cat([visible_sealed[:, None, :].expand(-1, q_pos.shape[1], -1), causal], 2)

    def _window_lse(self, lse: torch.Tensor, q: torch.Tensor, qh: torch.Tensor, tails: TailBatch,
                    keys: torch.Tensor, visible_sealed: torch.Tensor, tail_pos: torch.Tensor,
                    scale: float) -> None:
        """Write lse[window rows, qh]: the window queries' log-sum-exps over all their keys."""
        q_win = q[:, qh][tails.win_row]  # [B, w, Hq_g, D]
        mask = self._mask(visible_sealed, tail_pos, torch.where(tails.win_valid, tails.win_pos, -1))
        logits = _logits(q_win, keys, mask, scale)  # [B, w, H_p, G, L]
        lse_w = torch.logsumexp(logits, -1).flatten(2)  # [B, w, Hq_g]
        lse[tails.win_row[tails.win_valid][:, None], qh] = lse_w[tails.win_valid]


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
