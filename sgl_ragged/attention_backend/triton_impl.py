"""Triton attention (the CUDA default): one kernel launch per layer for the whole batch.

Decode batches use the split-KV decode kernel driven by the static split map (kernels/aot.py);
extend and mixed batches the extend kernel. Both return the log-sum-exp of every query row,
from which the window queries' attention over the tail (the scorer's input) is recomputed on
the tail alone, without a second pass over the sealed rows. The tail's staging and sealing then
reuse the torch reference's code per request (torch_ref.store_tail), so the stored statistics
are the reference's by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_ragged.attention_backend import torch_ref
from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.metadata import RaggedForwardMetadata, RequestPlan
from sgl_ragged.kernels.aot import SplitStrategy, device_parallelism, split_plan
from sgl_ragged.kernels.batch import KernelBatch, kernel_batch
from sgl_ragged.kernels.decode import decode_attention
from sgl_ragged.kernels.extend import extend_attention
from sgl_ragged.kernels.tables import all_layer_tables
from sgl_ragged.mem_pool.storage import RaggedStorage


class TritonAttention(AttentionImpl):
    """Ragged attention with the Triton kernels; the split map is fixed at construction."""

    def __init__(self, storage: RaggedStorage, split_ratios: Sequence[Sequence[float]],
                 strategy: SplitStrategy = SplitStrategy.AOT, num_ctas: int | None = None) -> None:
        super().__init__(storage)
        self.tables = all_layer_tables(storage)
        ctas = num_ctas or device_parallelism(storage.device)
        self.splits = split_plan(split_ratios, ctas, storage.device, strategy)

    def prepare(self, meta: RaggedForwardMetadata) -> None:
        meta.kernel = kernel_batch(meta.requests, self.storage.device)

    def forward(self, layer: int, meta: RaggedForwardMetadata, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        out, lse = self.attend(layer, meta.kernel, q, k, v, scale, decode)
        for plan in meta.requests:
            rows = slice(plan.q_start, plan.q_start + plan.q_len)
            self._store_tail(layer, plan, q[rows], k[rows], v[rows], lse[rows], scale)
        return out

    def attend(self, layer: int, batch: KernelBatch | None, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention only: out [N, H_q, D] and lse [N, H_q] float32, one launch (two for decode)."""
        assert batch is not None, "prepare() did not run for this forward"
        st = self.storage
        if decode:
            return decode_attention(q, k, v, st.stage_k[layer], st.stage_v[layer],
                                    self.tables[layer], self.splits.layer(layer), batch, scale)
        return extend_attention(q, k, v, st.stage_k[layer], st.stage_v[layer], self.tables[layer],
                                batch, scale)

    def _store_tail(self, layer: int, plan: RequestPlan, q: torch.Tensor, k_new: torch.Tensor,
                    v_new: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
        """Per request: the tail's window attention from the kernel's LSE, then the reference's
        staging and sealing."""
        tail_k, tail_v = torch_ref.tail_kv(self.storage, layer, plan, k_new, v_new)  # [T, H, D]
        w = plan.obs_queries
        tail_attn = window_tail_attention(q[-w:], lse[-w:], tail_k, plan, scale)  # [H, T]
        torch_ref.store_tail(self.storage, layer, plan, tail_k, tail_v, tail_attn, q[-w:], scale)


def window_tail_attention(q_win: torch.Tensor, lse_win: torch.Tensor, tail_k: torch.Tensor,
                          plan: RequestPlan, scale: float) -> torch.Tensor:
    """[H, T] float32 attention mass the tail received from the window queries, max-reduced
    over the query heads of each KV head and summed over the queries.

    q_win: [w, H_q, D] the last w queries; lse_win: [w, H_q] their log-sum-exp over all visible
    keys (sealed rows included); tail_k: [T, H, D].
    """
    w, h_q, _ = q_win.shape
    T, h_kv, _ = tail_k.shape
    keys = tail_k.float().repeat_interleave(h_q // h_kv, dim=1)  # [T, H_q, D]
    logits = torch.einsum("qhd,thd->qht", q_win.float(), keys) * scale
    q_pos = torch.arange(plan.seq_len - w, plan.seq_len, device=q_win.device)
    k_pos = torch.arange(plan.tail_start, plan.seq_len, device=q_win.device)
    visible = k_pos[None, None, :] <= q_pos[:, None, None]  # [w, 1, T]
    probs = torch.where(visible, torch.exp(logits - lse_win.float()[..., None]), 0.0)
    return probs.view(w, h_kv, h_q // h_kv, T).amax(2).sum(0)
