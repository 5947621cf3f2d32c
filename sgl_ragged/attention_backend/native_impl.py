"""Native CPU attention: the C++ kernels of cuda_ext/ (built by sgl_ragged/native), one call
per layer for the whole batch, then the batched torch staging and sealing (`store_tails`, its
window statistics in C++: cuda_ext/tails.cpp). Decode forwards (whose sealed pages were all
staged before) write only their new tokens' staging slots (`tail_batch.stage_fresh`).
Forwards with prefill chunks stay native where the kernels measured faster (`prefill_on_batched`:
bfloat16 storages on the amx variant's tiles, the avx512 variant on a CPU without AMX, whose
bfloat16 chunks run as AVX512-BF16 matrix products, and the avx2 variant there, whose chunks
multiply key columns) and go to the batched torch path elsewhere (its window statistics still
from tails.cpp).

The kernels attend on the rows as stored: hi slots at the storage dtype (or, with
--ragged-precision H+L, quantized), the low tier on its codes (scales folded into the queries
and probabilities, cuda_ext/attention_body.inc), each group in its own formats, then
each request's tail pages (`tail_batch.tail_pages`), causal by position. Tables built once per
forward by `prepare` (B requests, S sealed pages in all; int64, CPU):

    | table        | shape  | meaning                                                          |
    |--------------|--------|------------------------------------------------------------------|
    | requests     | [B, 6] | q_start, q_len, prefix, tail_start, first tail page m, tail pages |
    | sealed_off   | [B + 1]| request b's sealed pages are sealed_pages[sealed_off[b]:...[b+1]]  |
    | sealed_pages | [S]    | logical pages of the sealed rows, request by request              |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from sgl_ragged.attention_backend.batched_torch import BatchedTorchAttention, BatchedTorchBatch
from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.ops import intra_op_threads
from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.tail_batch import (
    TailBatch,
    stage_fresh,
    store_tails,
    tail_batch,
    tail_pages,
)
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import QuantTier, native_fields
from sgl_ragged.mem_pool.staging_stats import StagedQueryStats
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.native import pool as native_pool
from sgl_ragged.precision import LowPrecision

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
EXTEND_ON_BATCHED = True
"""Forwards with a prefill chunk (any request with more than one query) may run on the batched
torch path: where `prefill_on_batched` says it beats the kernels. False: every forward native."""
SERIAL_TAIL_TOKENS = 2**13
"""Tail pages of at most this many tokens (decode batches, short chunks) are gathered, staged and
sealed on the calling thread alone: each of their ~30 small ops per layer would otherwise wake
torch's pool (batch 8 x 2K decode: the tails' time about halved, shared machine)."""
SERIAL_PAIRS = 2**12
"""Layers with fewer (query row, key) pairs run on the calling thread, their key ranges unsplit.
On the kernels' own pool (cuda_ext/pool.cpp) a split costs little, its caller never waiting for a
worker to wake: 2^12 served decode x1.19 / 1.14 at 4 / 16 requests over 2^16 on a Zen 4
(docs/results.md, "The native kernels' own pool (session 67)")."""
SERIAL_PAIRS_OPENMP = 2**16
"""The same under RAGGED_NATIVE_POOL=openmp: waking OpenMP's pool (OMP_WAIT_POLICY=PASSIVE)
costs more than a second core gives."""


def default_serial_pairs(env: dict[str, str] | None = None) -> int:
    """SERIAL_PAIRS on the kernels' own pool, SERIAL_PAIRS_OPENMP under RAGGED_NATIVE_POOL=openmp."""
    return SERIAL_PAIRS_OPENMP if native_pool.kind(env) == "openmp" else SERIAL_PAIRS


def native_refuses(storage: RaggedStorage) -> str | None:
    """Why the native kernels cannot serve this storage (device, dtype, head size), or None."""
    if storage.device.type != "cpu":
        return f"runs on the CPU, the KV cache is on {storage.device.type}"
    if storage.dtype not in NATIVE_DTYPES:
        return f"runs float32 and bfloat16 caches, not {storage.dtype}"
    if storage.layout.head_dim % 16:
        return f"needs a head_dim that is a multiple of 16, not {storage.layout.head_dim}"
    return None


TILE_ISAS = ("amx", "avx512")
"""ISA variants that run bfloat16 prefill chunks as bfloat16 matrix products (S = Q K^T and
acc += bf16(P) V, attention_body.inc's RAGGED_TILES): on AMX tiles through cpublas's brgemm
(amx) or on vdpbf16ps (avx512); the avx2 and scalar variants keep float32 loops (avx2: blocks
of prefill rows against key columns in float32 FMAs, integer tiers of bfloat16 storages on
vpmaddwd, also as columns)."""


def extends_on_tiles(storage: RaggedStorage, module: ModuleType) -> bool:
    """The kernels run this storage's prefill chunks as bfloat16 matrix products (bfloat16
    rows on a TILE_ISAS variant)."""
    return storage.dtype == torch.bfloat16 and module.isa() in TILE_ISAS


def prefill_on_batched(storage: RaggedStorage, module: ModuleType) -> bool:
    """Whether this storage's prefill chunks run faster on the batched torch path than on the
    kernels (bench.cpu_attention --native, whole prefill forwards; docs/results.md):
    - amx variant: bfloat16 chunks are tile products and beat batched (x1.1-1.6 at 1K-4K on a
      Sapphire Rapids-class CPU); float32 ones go to batched.
    - avx512 variant on a CPU with AMX (forced lower): torch's SDPA multiplies on the tiles and
      beat the kernels' float32 loops (native 0.37-0.56x of batched; measured before avx512
      ran bfloat16 chunks on vdpbf16ps).
    - avx512 variant on a CPU without AMX: every forward native. On an AMD EPYC (Zen 4, torch
      has no tiles either) the float32 loops won x1.2-2.1 at 1K-4K and lost 8-18% at 16K on
      bfloat16 rows; the vdpbf16ps products (session 14) win at every length (see
      docs/results.md, "bfloat16 prefill chunks on AVX512-BF16"). bfloat16 prefill there
      flipped the default model's answer to a question whose first token is a 0.1-logit tie
      in float32 (below bfloat16's resolution of the logits); answer-token top-1 in
      bench.accuracy was no worse (full 0.811 vs 0.807 batched, the default profile 0.807 vs
      0.800, with the float32 loops).
    - avx2 variant: every forward native on a CPU without AMX. Since session 60 it multiplies
      blocks of up to 96 prefill rows on key columns (attention_body.inc, put_columns): on a
      Zen 3 (AVX2 only, GOMP_SPINCOUNT=3000 as served) x1.23-1.80 batched's speed at 256-token
      chunks after 1K-4K of history, batch 1-4, drop-only and int4@0.3 rows alike; before, the
      per-key loops lost at 4K (x0.75-0.89; session 21's intrinsics x0.65-0.84 but x1.51 at
      1 x 1K). On an AMX CPU (forced lower) batched, as for avx512.
    - scalar variant: batched.
    RAGGED_NATIVE_PREFILL=native|batched overrides the rule (measurements, other CPUs)."""
    forced = os.environ.get("RAGGED_NATIVE_PREFILL", "")
    if forced:
        if forced not in ("native", "batched"):
            raise ValueError(f"RAGGED_NATIVE_PREFILL={forced} is not a choice: set it to native "
                             "(prefill chunks on the kernels) or batched (on batched torch), "
                             "or unset it for the measured rule")
        return forced == "batched"
    isa = module.isa()
    if isa == "amx":
        return not extends_on_tiles(storage, module)
    if isa in ("avx512", "avx2"):
        from sgl_ragged import native

        return native.cpu_has_amx()
    return True


def _group_formats(layout: RaggedLayout, layer: int) -> torch.Tensor:
    """[groups, 4] int64 of one layer: each group's (low bits, low is_float, high bits, high
    is_float), 0 bits where the group has no such tier (the high tier: the model dtype)."""

    def fmt(p: LowPrecision | None) -> tuple[int, int]:
        return (p.bits, int(p.is_float)) if p is not None else (0, 0)

    return torch.tensor([[*fmt(layout.low_format(layer, g)), *fmt(layout.high)]
                         for g in range(len(layout.tiers[layer]))], dtype=torch.long).view(-1, 4)


def _tier_tensors(tiers: list[QuantTier | None]) -> list[torch.Tensor]:
    """The kernels' 6 tensors per group (`native_fields`: k_codes, k_scale, k_zero, v_codes,
    v_scale, v_zero; empty where the group has no such tier or the format no zero points)."""
    return [t for tier in tiers for t in native_fields(tier)]


@dataclass(frozen=True)
class NativeBatch:
    """What `NativeAttention.prepare` builds once per forward (module table)."""

    tails: TailBatch | None  # the batch's tail pages (staging and sealing); None: batched
    batched: BatchedTorchBatch | None  # a forward with prefill chunks (prefill_on_batched)
    requests: torch.Tensor  # [B, 6] int64
    sealed_off: torch.Tensor  # [B + 1] int64
    sealed_pages: torch.Tensor  # [S] int64


class NativeAttention(AttentionImpl[NativeBatch]):
    """Ragged attention in C++ (cuda_ext/), batched over requests and head groups."""

    def __init__(self, storage: RaggedStorage, module: ModuleType | None = None,
                 serial_pairs: int | None = None,
                 extend_on_batched: bool = EXTEND_ON_BATCHED) -> None:
        super().__init__(storage)
        self.serial_pairs = default_serial_pairs() if serial_pairs is None else serial_pairs
        refused = native_refuses(storage)
        if refused:
            raise ValueError(f"--ragged-attention native {refused}; use --ragged-attention "
                             "batched (or auto)")
        if module is None:
            from sgl_ragged import native

            module = native.load()
        self.module = module
        # Window statistics in C++ (a module without them, e.g. an older build passed as
        # bench's baseline, gets the torch form), here and for the chunks handed over.
        self.stats = self.window_stats if hasattr(module, "window_stats") else None
        extend_on_batched = extend_on_batched and prefill_on_batched(storage, module)
        self.batched = (BatchedTorchAttention(storage, stats=self.stats) if extend_on_batched
                        else None)
        layout = storage.layout
        # Per layer: KV head -> (group, slot in group) [H, 2], the groups' formats [groups, 4]
        # and their quantized tiers (6 tensors per group, empty where a group has none).
        self.head_map = [self._head_map(layer) for layer in range(layout.num_layers)]
        self.formats = [_group_formats(layout, layer) for layer in range(layout.num_layers)]
        self.low = [_tier_tensors(storage.low_rows[layer]) for layer in range(layout.num_layers)]
        self.high = [_tier_tensors(storage.high_rows[layer]) for layer in range(layout.num_layers)]

    def _head_map(self, layer: int) -> torch.Tensor:
        table = torch.empty(self.storage.layout.num_kv_heads, 2, dtype=torch.long)
        for g, heads in enumerate(self.storage.head_index[layer]):
            for slot, h in enumerate(heads.tolist()):
                table[h] = torch.tensor([g, slot])
        return table

    def prepare(self, plan: BatchPlan) -> NativeBatch:
        assert plan.staged, "planner.take_staging did not run for this plan"
        if self.batched is not None and any(p.q_len > 1 for p in plan.requests):
            empty = torch.empty(0, dtype=torch.long)
            return NativeBatch(tails=None, batched=self.batched.prepare(plan), requests=empty,
                               sealed_off=empty, sealed_pages=empty)
        P = self.storage.layout.page_size
        rows, offsets, first = [], [0], 0
        for p in plan.requests:
            count = p.tail_pages.numel()
            rows.append([p.q_start, p.q_len, p.prefix, p.tail_start, first, count])
            offsets.append(offsets[-1] + p.sealed_pages.numel())
            first += count
        sealed = [p.sealed_pages.cpu() for p in plan.requests]
        return NativeBatch(
            tails=tail_batch(plan.requests, P, self.storage.device, in_place=True), batched=None,
            requests=torch.tensor(rows, dtype=torch.long).view(-1, 6),
            sealed_off=torch.tensor(offsets, dtype=torch.long),
            sealed_pages=torch.cat(sealed) if sealed else torch.empty(0, dtype=torch.long))

    def forward(self, layer: int, batch: NativeBatch, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, decode: bool) -> torch.Tensor:
        if batch.batched is not None:
            return self.batched.forward(layer, batch.batched, q, k, v, scale, decode)
        if q.dtype != self.storage.dtype:
            raise ValueError(f"native attention: q is {q.dtype} but the KV cache is "
                             f"{self.storage.dtype}")
        k_pages, v_pages = self.stage(layer, batch, k, v)
        out, lse = self.attend(layer, batch, q, k_pages, v_pages, scale)
        self.store(layer, batch, q, k_pages, v_pages, lse, scale)
        return out

    # forward's three steps (bench.decode_step times them apart)

    def _tail_threads(self, batch: NativeBatch) -> int:
        """The tails' gathers, staging and sealing are small tensor ops: on one thread unless
        the tail pages are many (waking the pool per op costs more than it gives)."""
        tokens = batch.tails.page_req.numel() * self.storage.layout.page_size
        return 1 if tokens <= SERIAL_TAIL_TOKENS else torch.get_num_threads()

    def stage(self, layer: int, batch: NativeBatch, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every tail page's K and V [M, P, H, D] for the kernels (in place: only the new
        tokens' slots written first)."""
        tails, st = batch.tails, self.storage
        with intra_op_threads(self._tail_threads(batch)):
            if tails.in_place:
                return stage_fresh(st, layer, tails, k, v, getattr(self.module, "copy_rows", None),
                                   getattr(self.module, "gather_pages", None))
            return tail_pages(st, layer, tails, k, v)

    def attend(self, layer: int, batch: NativeBatch, q: torch.Tensor, k_pages: torch.Tensor,
               v_pages: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' attention of one layer: the output and each row's log-sum-exp."""
        st = self.storage
        return self.module.attend(
            q.contiguous(), k_pages.contiguous(), v_pages.contiguous(), st.rows_k[layer],
            st.rows_v[layer], self.low[layer], self.high[layer], self.formats[layer],
            self.head_map[layer], batch.requests, batch.sealed_off, batch.sealed_pages, scale,
            self.serial_pairs)

    def store(self, layer: int, batch: NativeBatch, q: torch.Tensor, k_pages: torch.Tensor,
              v_pages: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
        """The tails' window statistics, seals and staging (`store_tails`)."""
        with intra_op_threads(self._tail_threads(batch)):
            store_tails(self.storage, layer, batch.tails, k_pages, v_pages, q, lse, scale,
                        stats=self.stats, kv_staged=batch.tails.in_place)

    def window_stats(self, storage: RaggedStorage, layer: int, tails: TailBatch,
                     k_pages: torch.Tensor, q: torch.Tensor, lse: torch.Tensor,
                     scale: float) -> StagedQueryStats:
        """tail_batch.window_stats in one C++ call (cuda_ext/tails.cpp)."""
        s = storage.stats
        attn, q_sum, q_sq, q_cnt = self.module.window_stats(
            q.contiguous(), lse, k_pages.contiguous(), tails.page_win_row, tails.page_win_pos,
            tails.page_start, tails.n_staged, tails.held_stage, s.attn, s.q_sum, s.q_sq_sum,
            s.q_count, layer, scale)
        return StagedQueryStats(attn=attn, q_sum=q_sum, q_sq_sum=q_sq, q_count=q_cnt)
