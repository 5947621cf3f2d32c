"""Triton attention (the CUDA default): one kernel launch per layer for the whole batch.

Decode batches use the split-KV decode kernel driven by the static split map (kernels/aot.py);
extend and mixed batches the extend kernel. Both return the log-sum-exp of every query row, from
which the window queries' attention over the tail (the scorer's input) is recomputed on the tail
alone, without a second pass over the sealed rows. Staging and sealing then run for the whole
batch at once (tail_batch.store_tails) through the storage's one sealer; the rows it selects
are written by the sealing kernel, `KernelRowWriter`, which the constructor installs as the
storage's row writer (`RaggedStorage.use_row_writer`: its address tables are the storage's
tensors, so finish-time sealing takes the kernel too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.tail_batch import store_tails, tail_pages
from sgl_ragged.attention_backend.triton_batch import TritonBatch, triton_batch
from sgl_ragged.kernels.aot import (
    MAX_PROGRAMS_PER_SM,
    PROGRAMS_PER_SM,
    SplitStrategy,
    device_parallelism,
    split_plan,
)
from sgl_ragged.kernels.batch import KernelBatch
from sgl_ragged.kernels.decode import decode_attention, split_kernel_resources
from sgl_ragged.kernels.extend import extend_attention
from sgl_ragged.kernels.occupancy import SMLimits, programs_per_sm
from sgl_ragged.kernels.seal import seal_pages
from sgl_ragged.kernels.tables import LayerTables, all_layer_tables, format_parts
from sgl_ragged.mem_pool.sealer import Selection
from sgl_ragged.mem_pool.storage import RaggedStorage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelRowWriter:
    """The storage's row writer on the Triton path (mem_pool/storage.RowWriter): the sealing
    kernel (kernels/seal.py) applies a TierRows selection's ranks and scatters the rows of one
    layer in one launch; pages of -1 are padding and write nothing."""

    tables: Sequence[LayerTables]  # per layer, the addresses of the storage's row tensors
    parts: Sequence[tuple[LayerTables, ...]]  # per layer, its launches' tables (format_parts)

    def __call__(self, layer: int, pages: torch.Tensor, k_tok: torch.Tensor,
                 v_tok: torch.Tensor, selection: Selection) -> None:
        if selection.keep is not None:
            raise ValueError("the sealing kernel writes tiered rows, not the dynamic reference "
                             "mode's keep masks; serve dynamic:<rho> with --ragged-attention "
                             "reference")
        index = torch.arange(pages.numel(), dtype=torch.int32, device=pages.device)
        seal_pages(self.tables[layer], k_tok, v_tok, index, pages.int(), selection.scores,
                   selection.sinks, self.parts[layer])


class TritonAttention(AttentionImpl[TritonBatch]):
    """Ragged attention with the Triton kernels; the split map is fixed at construction."""

    supports_cuda_graph = True

    def __init__(self, storage: RaggedStorage, split_ratios: Sequence[Sequence[float]],
                 strategy: SplitStrategy = SplitStrategy.AOT, num_ctas: int | None = None,
                 num_q_heads: int | None = None) -> None:
        """num_ctas: N_CTA of the split map; by default SMs x the split kernel's resident
        programs per SM (at most aot.MAX_PROGRAMS_PER_SM), measured from its build for
        num_q_heads query heads when given."""
        super().__init__(storage)
        self.tables = all_layer_tables(storage)
        # Per layer, each launch's tables: one per low format (--ragged-precision mixed).
        self.parts = tuple(format_parts(t, storage.layout, layer)
                           for layer, t in enumerate(self.tables))
        if num_ctas is None:
            num_ctas = decode_parallelism(storage, self.tables[0], split_ratios, num_q_heads)
        self.splits = split_plan(split_ratios, num_ctas, storage.device, strategy)
        self.part_splits = tuple(tuple((t, self.splits.layer(layer).of_groups(t.groups))
                                       for t in parts) for layer, parts in enumerate(self.parts))
        storage.use_row_writer(KernelRowWriter(self.tables, self.parts))
        # Its stores must be torch ops a decode graph captures: the native store_stats (a CPU
        # storage's) is not one (only the tests' CPU stand-in of a graph meets it).
        storage.native_stats = False

    def prepare(self, plan: BatchPlan) -> TritonBatch:
        assert plan.staged, "planner.take_staging did not run for this plan"
        return triton_batch(plan, self.storage.layout.page_size, self.storage.device)

    def forward(self, layer: int, batch: TritonBatch, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        out, lse = self.attend(layer, batch.kernel, q, k, v, scale, decode)
        k_pages, v_pages = tail_pages(self.storage, layer, batch.tails, k, v)
        store_tails(self.storage, layer, batch.tails, k_pages, v_pages, q, lse, scale)
        return out

    def attend(self, layer: int, batch: KernelBatch, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention only: out [N, H_q, D] and lse [N, H_q] float32, one launch (two for decode)."""
        st = self.storage
        if decode:
            return decode_attention(q, k, v, st.stage_k[layer], st.stage_v[layer],
                                    self.tables[layer], self.splits.layer(layer), batch, scale,
                                    parts=self.part_splits[layer])
        return extend_attention(q, k, v, st.stage_k[layer], st.stage_v[layer], self.tables[layer],
                                batch, scale, parts=self.parts[layer])


def decode_parallelism(storage: RaggedStorage, tables: LayerTables,
                       split_ratios: Sequence[Sequence[float]], num_q_heads: int | None,
                       max_programs_per_sm: int = MAX_PROGRAMS_PER_SM) -> int:
    """N_CTA on this device: SMs x resident programs per SM of the split kernel as compiled
    for these shapes, at most max_programs_per_sm (aot.MAX_PROGRAMS_PER_SM as served;
    bench.decode_breakdown --programs-per-sm measures other caps). Where residency cannot be
    measured (not CUDA, no head count, or a Triton build that does not expose its resource
    use) it is aot.PROGRAMS_PER_SM, under the same cap."""
    device = storage.device
    fallback = min(PROGRAMS_PER_SM, max_programs_per_sm)
    if device.type != "cuda" or num_q_heads is None:
        return device_parallelism(device, fallback)
    probe = split_plan(split_ratios, 1, device)  # one split per group: sizes the probe's buffers
    try:
        used = split_kernel_resources(tables, probe.layer(0), num_q_heads,
                                      storage.layout.head_dim, storage.dtype)
    except (AttributeError, RuntimeError, TypeError) as exc:
        logger.warning("could not read the split kernel's resource use (%s); assuming %d "
                       "programs per SM", exc, fallback)
        return device_parallelism(device, fallback)
    resident = programs_per_sm(used, SMLimits.of(device))
    num_ctas = device_parallelism(device, min(resident, max_programs_per_sm))
    logger.info("decode split kernel: %d registers/thread, %d B shared, %d warps -> %d programs "
                "per SM resident, N_CTA %d", used.registers_per_thread, used.shared_bytes,
                used.num_warps, resident, num_ctas)
    return num_ctas
