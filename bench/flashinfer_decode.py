"""FlashInfer baseline for bench/decode_attention.py (measurement only, CUDA only).

TANGRAM section 3.1.3's dynamic-rebalancing baseline: every (layer, group) is an ordinary NHD
paged cache with page size k[l,g] (rows_k[l][g] is exactly that) and the same page indices, and
BatchDecodeWithPagedKVCacheWrapper.plan() runs again for every layer and group of every step,
because the retained lengths differ per group. The tail is merged with our tail and merge kernels,
fed FlashInfer's output as the group's single partial.
"""

from __future__ import annotations

import math
import time

import torch

from sgl_ragged.kernels.batch import KernelBatch
from sgl_ragged.kernels.decode import tail_merge
from sgl_ragged.kernels.tables import LayerTables
from sgl_ragged.mem_pool.storage import RaggedStorage

WORKSPACE_BYTES = 128 * 2**20


class FlashInferPlannedDecode:
    """Decode attention with per-(layer, group) FlashInfer planning; records planning time."""

    def __init__(self, storage: RaggedStorage, tables: list[LayerTables], gqa: int) -> None:
        if storage.device.type != "cuda":
            raise RuntimeError("the FlashInfer baseline needs a CUDA device")
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        self.storage, self.tables, self.gqa = storage, tables, gqa
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=storage.device)
        self.wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        # qheads[l][g]: [H_p * gqa] int64 query heads reading group g, in the rows' head order.
        self.qheads = [[(h[:, None] * gqa + torch.arange(gqa, device=h.device)).flatten()
                        for h in layer] for layer in storage.head_index]
        self.ones = [torch.ones(t.num_groups, dtype=torch.int32, device=storage.device)
                     for t in tables]
        self.plan_seconds = 0.0  # host time spent in plan(), summed since the last reset

    def set_batch(self, batch: KernelBatch, sealed_pages: list[torch.Tensor]) -> None:
        """Page indices of this step (the same for every group): indptr on the host."""
        counts = [p.numel() for p in sealed_pages]
        self.indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        self.indices = torch.cat(sealed_pages).to(self.storage.device, torch.int32)
        self.batch = batch

    def layer(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: plan + run per group, then the tail merge. Returns out, lse (ln)."""
        st, t = self.storage, self.tables[layer]
        B, h_q, d = q.shape
        # One sealed partial per query head (slot 0) and the tail's (slot 1, tail_merge's).
        mid_o = torch.empty(B, h_q, 2, d, dtype=torch.float32, device=q.device)
        mid_l = torch.empty(B, h_q, 2, dtype=torch.float32, device=q.device)
        for g, k in enumerate(st.layout.slots[layer]):
            h_p = st.head_index[layer][g].numel()
            last = torch.full((B,), k, dtype=torch.int32)
            t0 = time.perf_counter()
            self.wrapper.plan(self.indptr, self.indices, last, h_p * self.gqa, h_p, d, k,
                              q_data_type=q.dtype, kv_data_type=st.dtype, sm_scale=scale)
            self.plan_seconds += time.perf_counter() - t0
            qh = self.qheads[layer][g]
            o, lse2 = self.wrapper.run(q.index_select(1, qh), (st.rows_k[layer][g],
                                       st.rows_v[layer][g]), return_lse=True)
            mid_o[:, qh, 0] = o.float()
            mid_l[:, qh, 0] = lse2 * math.log(2.0)  # FlashInfer's decode LSE is base 2
        out, lse = torch.empty_like(q), torch.empty(B, h_q, dtype=torch.float32, device=q.device)
        tail_merge(q, k_new, v_new, st.stage_k[layer], st.stage_v[layer], t, self.ones[layer],
                   self.batch, mid_o, mid_l, scale, out, lse)
        return out, lse
