"""Static per-layer tables the kernels read: which heads form each group, its slots and rows.

Built once per storage (the row tensors are allocated once and only written in place, so their
addresses are stable). Groups of one layer live in separate tensors of different shapes; a
kernel reaches group g through `rows_k_ptr[g]`, the address of `rows_k[l][g]`, cast to a
pointer in the kernel. Index spaces: group g in [0, G), member j in [0, H_p), KV head h in
[0, H).

Rows with a low tier (mem_pool/quant.py, docs/architecture.md, "Row tiers"): slot s < hi[l][g] of a page is
rows_k[l][g][page, s]; slot s >= hi is low-tier slot s - hi, whose codes and quantization
parameters the kernels reach through `low_ptr[g]` (the six tensors of `low_rows[l][g]`, in
`LOW_TENSORS` order; 0 where a group has no low tier or the format no zero points). With a
quantized high tier (--ragged-precision H+L) the hi slots are not in rows_k (it keeps none) but
in `high_rows[l][g]`, whose six tensors are columns 6-11 of the same `low_ptr[g]` row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton.language as tl

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import QuantTier
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.precision import LowPrecision

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype not in TL_DTYPES:
        raise TypeError(f"the ragged kernels support {list(TL_DTYPES)}, not {dtype}")
    return TL_DTYPES[dtype]


LOW_TENSORS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
"""Columns of LayerTables.low_ptr (the kernels index them by position); columns
len(LOW_TENSORS) + i hold the high tier's, in the same order."""

TIER_COLUMNS = 2 * len(LOW_TENSORS)
"""Width of a low_ptr row: the low tier's tensors, then the high tier's (the kernels' `g * 12`)."""


ADDRESS_ALIGN = 16
"""Every address in a LayerTables is a multiple of this (checked when built): the kernels tell
Triton so (quant.table_ptr), which lets it load rows and codes 16 bytes at a time."""


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class LayerTables:
    """One layer's group structure as device tensors."""

    rows_k_ptr: torch.Tensor  # [G] int64 address of rows_k[l][g] ([pages, k_g, H_p, D])
    rows_v_ptr: torch.Tensor  # [G] int64 address of rows_v[l][g]
    slots: torch.Tensor  # [G] int32 k[l][g], row slots per logical page (hi + lo)
    hi_slots: torch.Tensor  # [G] int32 hi[l][g], the full-precision ones (rows_k's dim 1)
    low_ptr: torch.Tensor  # [G, 12] int64 addresses of low_rows[l][g]'s tensors (LOW_TENSORS), then high_rows[l][g]'s
    group_heads: torch.Tensor  # [G, H_p] int32 KV heads of each group
    head_group: torch.Tensor  # [H] int32 group of each KV head
    head_member: torch.Tensor  # [H] int32 position j of the head inside its group
    heads_per_group: int
    max_slots: int
    rows_dtype: torch.dtype
    heads: torch.Tensor  # [n] int32 KV heads the extend and sealing kernels run for: all, or a
    # format part's (format_parts)
    low: LowPrecision | None  # the low tier's format (None: no group has one)
    high: LowPrecision | None = None  # the high tier's format (None: the model dtype)
    groups: tuple[int, ...] | None = None  # the groups the launches cover (None: all)

    @property
    def num_groups(self) -> int:
        return self.slots.numel()

    @property
    def low_bits(self) -> int:
        """Code bits of the low tier, 0 without one (the kernels' LOW_BITS)."""
        return 0 if self.low is None else self.low.bits

    @property
    def low_float(self) -> bool:
        """The low tier is fp8 (e4m3, scale only; the kernels' LOW_FLOAT)."""
        return self.low is not None and self.low.is_float

    @property
    def high_bits(self) -> int:
        """Code bits of a quantized high tier, 0 at the model dtype (the kernels' HIGH_BITS)."""
        return 0 if self.high is None else self.high.bits

    @property
    def high_float(self) -> bool:
        """The high tier is fp8 (the kernels' HIGH_FLOAT)."""
        return self.high is not None and self.high.is_float


def layer_tables(storage: RaggedStorage, layer: int) -> LayerTables:
    """Tables of one layer of `storage`, on the storage's device."""
    layout, dev = storage.layout, storage.device
    groups, slots = layout.groups[layer], layout.slots[layer]
    head_group = [0] * layout.num_kv_heads
    head_member = [0] * layout.num_kv_heads
    for g, heads in enumerate(groups):
        for j, h in enumerate(heads):
            head_group[h], head_member[h] = g, j

    def ptrs(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in rows], dtype=torch.int64, device=dev)

    def i32(values: object) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=dev)

    def tier_ptrs(tier: QuantTier | None) -> list[int]:
        return [0 if tier is None or getattr(tier, name) is None else getattr(tier, name).data_ptr()
                for name in LOW_TENSORS]

    low = [tier_ptrs(lo) + tier_ptrs(hi)
           for lo, hi in zip(storage.low_rows[layer], storage.high_rows[layer], strict=True)]
    rows = [*storage.rows_k[layer], *storage.rows_v[layer]]
    misaligned = [a for a in [*(t.data_ptr() for t in rows), *(a for r in low for a in r)]
                  if a % ADDRESS_ALIGN]
    if misaligned:
        raise ValueError(f"layer {layer}'s row tensors start at {misaligned[0]:#x}, not a "
                         f"multiple of {ADDRESS_ALIGN} bytes: the kernels load them 16 bytes at "
                         "a time (quant.table_ptr); allocate each row tensor on its own")
    if layout.quantized and layout.head_dim != next_pow2(layout.head_dim):
        raise ValueError(f"the Triton kernels pack low-tier codes for power-of-two head sizes "
                         f"only, not {layout.head_dim} (attention_backend/registry.triton_refuses)")
    return LayerTables(
        rows_k_ptr=ptrs(storage.rows_k[layer]),
        rows_v_ptr=ptrs(storage.rows_v[layer]),
        slots=i32(slots),
        hi_slots=i32([t.hi for t in layout.tiers[layer]]),
        low_ptr=torch.tensor(low, dtype=torch.int64, device=dev),
        group_heads=i32(groups),
        head_group=i32(head_group),
        head_member=i32(head_member),
        heads_per_group=len(groups[0]),
        max_slots=max(slots),
        rows_dtype=storage.dtype,
        low=layout.low,
        high=layout.high,
        heads=torch.arange(layout.num_kv_heads, dtype=torch.int32, device=dev),
    )


def all_layer_tables(storage: RaggedStorage) -> list[LayerTables]:
    return [layer_tables(storage, layer) for layer in range(storage.layout.num_layers)]


def format_parts(tables: LayerTables, layout: RaggedLayout, layer: int) -> tuple[LayerTables, ...]:
    """The launches a layer's low formats need: (tables,) where every group shares one (the
    kernels take it as a constexpr), else, for a low format per group (--ragged-precision
    mixed), one table per format in the layer (no low tier counts as one) covering its groups
    and their KV heads, in order of first appearance. All share the whole layer's tensors.
    Built once (host work): decode under a CUDA graph launches them as they are."""
    if not layout.mixed_formats:
        return (tables,)
    formats = [layout.low_format(layer, g) for g in range(tables.num_groups)]
    by_format: dict[LowPrecision | None, list[int]] = {}
    for g, fmt in enumerate(formats):
        by_format.setdefault(fmt, []).append(g)
    head_group = tables.head_group.tolist()
    return tuple(
        replace(tables, low=fmt, groups=tuple(groups),
                heads=torch.tensor([h for h, g in enumerate(head_group) if g in groups],
                                   dtype=torch.int32, device=tables.head_group.device))
        for fmt, groups in by_format.items())
