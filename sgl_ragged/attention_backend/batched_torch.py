"""Batched torch attention (the CPU default): the whole batch per head group, no request loop.

Per layer and group g, every request's keys are its sealed rows followed by its tail pages,
padded to the batch's longest, in three segments that each produce their own logits and
log-sum-exp (the sealed rows' hi slots, their low tier, the tail), merged by log-sum-exp: per
group one pass over the batch instead of one per (request, group) as in the reference
(torch_ref.py, still the oracle). The hi slots and the tail run on the CPU flash kernel in q's
dtype (segments_sdpa.py); the low tier in decode on its codes in float32 with the scales folded
into the query and probabilities (segments.py), in extend dequantized once then on the flash
kernel. A quantized high tier (--ragged-precision H+L: the hi slots in int8 or fp8, stored as
the low tier is) is one more segment read the low tier's way. Staging and sealing run batched
too (tail_batch.store_tails, through the storage's write API: `RaggedStorage.seal`).

Key column c of request b in group g (hi + lo slots per sealed page, S sealed pages at most);
query i sees it iff key_pos[b, c] <= q_pos[b, i]:

    | c                         | key                                          | key_pos               |
    |---------------------------|----------------------------------------------|-----------------------|
    | [0, S * hi)               | hi slot c % hi of page sealed_table[b, c // hi] | -1 (NEVER if padding) |
    | S * hi + c', c' < S * lo  | lo slot c' % lo of page sealed_table[b, c' // lo] | -1 (NEVER if padding) |
    | S * (hi + lo) + t         | token t < Tp * P of the request's tail pages | tail_pos[b, t]        |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.ops import intra_op_threads, take
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.attention_backend.segments import attend_low, low_kv
from sgl_ragged.attention_backend.segments_sdpa import attend_segment, dequantized_low, merge
from sgl_ragged.attention_backend.tail_batch import (
    TailBatch,
    WindowStats,
    store_tails,
    tail_batch,
    tail_pages,
    window_tables,
)
from sgl_ragged.mem_pool.quant import QuantTier
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.precision import LowPrecision

NEVER = 2**62
"""Position of padded keys: after every query."""

MAX_PADDED = 2**24
"""Padded (query, key) pairs per sub-batch: requests are attended together while
requests x longest query run x longest key run stays below this (one long prefill chunk
beside short ones would otherwise pad every request to its size); decode batches fit whole."""

SINGLE_THREAD_PAIRS = {True: 2**17, False: 2**16}
"""Decode (True) / extend (False) forwards with at most this many (query, logical key) pairs
run their attention on one intra-op thread: their ops are small, and waking the thread pool
for each (OMP_WAIT_POLICY=PASSIVE) costs more than the second core gives. Measured with
bench.cpu_attention on 2 cores: decode of 1-64 requests 1.2-3x faster at <= 70K pairs, 10%
slower at 133K (session 4). Extend: session 4 had a 256-token chunk 1.4x faster on one thread
at 330K pairs; on session 37's AVX2 EPYC (Zen 3, where every prefill chunk takes this path)
two threads were x1.07-1.67 faster from 82K pairs up (256-token chunks after 64-2048 tokens of
drop-only, int4 and per-head rows, GOMP_SPINCOUNT=3000 as served), x0.75-1.13 at 8-70K (64-token
chunks), and a served multi-turn run's TTFT p50 went x0.83 (docs/results.md, "An AVX2 EPYC,
session 37")."""


GroupAttention = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(group g, its KV heads [H_p]) -> out [B, Lq, H_p, G, D] float32, lse [B, Lq, H_p, G] float32."""


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
    win_in_q: torch.Tensor  # [B, w] int64 index of window query j among q_row[b] (0 where padded)
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
        win_in_q=dev(torch.where(win_valid, win_row - q_row_t[:, :1], 0)),
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

    def __init__(self, storage: RaggedStorage, max_padded: int = MAX_PADDED,
                 stats: WindowStats | None = None) -> None:
        """stats: the tails' window statistics (default the torch `tail_batch.window_stats`;
        NativeAttention passes its C++ form for the chunks it hands over)."""
        super().__init__(storage)
        self.max_padded = max_padded
        self.stats = stats

    def prepare(self, plan: BatchPlan) -> BatchedTorchBatch:
        assert plan.staged, "planner.take_staging did not run for this plan"
        P, device = self.storage.layout.page_size, self.storage.device
        return BatchedTorchBatch(tails=tail_batch(plan.requests, P, device),
                                 padded=padded_batches(plan.requests, P, device, self.max_padded))

    def forward(self, layer: int, batch: BatchedTorchBatch, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        small = sum(pb.pairs for pb in batch.padded) <= SINGLE_THREAD_PAIRS[decode]
        with intra_op_threads(1 if small else torch.get_num_threads()):
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
        store_tails(self.storage, layer, tails, k_pages, v_pages, q, lse, scale, self.stats)
        return out

    def _attend(self, layer: int, pb: PaddedBatch, q: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, scale: float, decode: bool,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, Lq, H_q, D] in q's dtype of every (padded) query and lse [B, w, H_q] float32
        of the window queries; padded entries hold garbage."""
        B, Lq = pb.q_row.shape
        _, _, H, D = k_pages.shape
        G = q.shape[1] // H
        q_pad = take(q, pb.q_row).view(B, Lq, H, G, D)
        tail_k, tail_v = (take(x, pb.tail_page).flatten(1, 2) for x in (k_pages, v_pages))  # [B, T, H, D]
        attend_group = self._group_attention(layer, pb, q_pad, tail_k, tail_v, scale, decode)
        # 1. Attention per group, written back at its heads.
        out = torch.empty(B, Lq, H, G, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Lq, H, G, dtype=torch.float32, device=q.device)
        for g, heads in enumerate(self.storage.head_index[layer]):
            out_g, lse_g = attend_group(g, heads)  # [B, Lq, H_p, G, D], [B, Lq, H_p, G]
            out.index_copy_(2, heads, out_g)
            lse.index_copy_(2, heads, lse_g)
        # 2. Every query's output; the window queries' log-sum-exps.
        win = pb.win_in_q[:, :, None].expand(-1, -1, H * G)
        return out.view(B, Lq, H * G, D).to(q.dtype), lse.view(B, Lq, H * G).gather(1, win)

    def _group_attention(self, layer: int, pb: PaddedBatch, q_pad: torch.Tensor,
                         tail_k: torch.Tensor, tail_v: torch.Tensor, scale: float, decode: bool,
                         ) -> GroupAttention:
        """Per group: the tail and the sealed hi slots on the CPU flash kernel in q's dtype, the
        low tier on its codes (decode, segments.py) or dequantized once (extend), merged by
        log-sum-exp (segments_sdpa.py). q_pad [B, Lq, H, G, D], tails [B, T, H, D]."""
        st = self.storage
        B, Lq, _, G, D = q_pad.shape
        S = pb.sealed_table.shape[1]
        # Tail: causal, the same additive mask for every group and query head.
        unseen = pb.tail_pos[:, None, :] > pb.q_pos[:, :, None]  # [B, Lq, T]
        tail_bias = torch.zeros(unseen.shape, dtype=q_pad.dtype, device=q_pad.device)
        tail_bias = tail_bias.masked_fill_(unseen, float("-inf"))[:, None]  # [B, 1, Lq, T]
        # A request without sealed pages sees nothing of the sealed segments.
        empty = torch.where(pb.num_sealed > 0, 0.0, float("-inf"))[:, None, None]  # [B, 1, 1]

        def attend_group(g: int, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            H_p = heads.numel()
            # [B, H_p * G, Lq, D]: query head h * G + g reads KV head h (the kernel's GQA)
            q_g = q_pad.index_select(2, heads).permute(0, 2, 3, 1, 4).reshape(B, H_p * G, Lq, D)
            parts = [attend_segment(q_g, tail_k.index_select(2, heads).transpose(1, 2),
                                    tail_v.index_select(2, heads).transpose(1, 2), tail_bias, scale)]
            rows = st.page_tiers(layer, g, pb.sealed_table.flatten())  # hi [B * S, hi, H_p, D]
            hi = rows.hi_k.shape[1]
            if hi:
                k, v = (x.view(B, S * hi, H_p, D).transpose(1, 2).to(q_g.dtype)
                        for x in (rows.hi_k, rows.hi_v))
                out_s, lse_s = attend_segment(q_g, k, v, _sealed_bias(pb.num_sealed, S, hi, q_g.dtype),
                                              scale)
                parts.append((out_s, lse_s + empty))
            for fmt, tier in ((st.layout.high, rows.high), (st.layout.low_format(layer, g), rows.low)):
                if tier is not None:  # a quantized high tier (H+L), the low tier
                    out_s, lse_s = self._quantized_segment(fmt, tier, pb, q_g, scale, decode)
                    parts.append((out_s, lse_s + empty))
            out_g, lse_g = merge(parts)  # [B, H_p * G, Lq, D], [B, H_p * G, Lq]
            return (out_g.view(B, H_p, G, Lq, D).permute(0, 3, 1, 2, 4),
                    lse_g.view(B, H_p, G, Lq).permute(0, 3, 1, 2))

        return attend_group

    def _quantized_segment(self, fmt: LowPrecision, tier: QuantTier, pb: PaddedBatch,
                           q_g: torch.Tensor, scale: float, decode: bool,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q_g [B, H_p * G, Lq, D] over one quantized tier of the run's sealed
        pages in format fmt (the low tier, or a quantized high tier: both store keys per (page,
        channel) and values per token; tier: quant.py's shapes, pages = B * S): out
        [B, H_p * G, Lq, D], lse [B, H_p * G, Lq] float32."""
        B, H_q, Lq, D = q_g.shape
        S, lo, H_p = pb.sealed_table.shape[1], tier.k_codes.shape[1], tier.k_codes.shape[2]
        if not decode:  # a chunk: dequantize once, then the flash kernel
            k, v = dequantized_low(fmt, tier, B, S, q_g.dtype)
            return attend_segment(q_g, k, v, _sealed_bias(pb.num_sealed, S, lo, q_g.dtype), scale)
        unseen = _sealed_pos(pb.num_sealed, S, lo)[:, None, :] == NEVER  # [B, 1, S * lo]
        q_f = q_g.reshape(B * H_p, H_q // H_p * Lq, D).to(torch.float32) * scale  # rows (g, i)
        out, lse = attend_low(q_f, low_kv(fmt, tier, B, S), unseen)
        return out.view(q_g.shape), lse.view(B, H_q, Lq)


def _sealed_bias(num_sealed: torch.Tensor, S: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, S * slots] additive mask of sealed slots (page-major): 0 for the request's
    num_sealed[b] pages, -inf for padding."""
    pos = _sealed_pos(num_sealed, S, slots)
    bias = torch.zeros(pos.shape, dtype=dtype, device=pos.device).masked_fill_(pos == NEVER, float("-inf"))
    return bias[:, None, None, :]


def _sealed_pos(num_sealed: torch.Tensor, S: int, slots: int) -> torch.Tensor:
    """[B, S * slots] int64 positions of sealed slots (page-major): -1 (seen by every query)
    for the request's num_sealed[b] pages, NEVER for padding."""
    exists = torch.arange(S * slots, device=num_sealed.device)[None, :] < num_sealed[:, None] * slots
    return torch.where(exists, -1, NEVER)
