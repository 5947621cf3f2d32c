"""Static per-layer tables the kernels read: which heads form each group, its slots and rows.

Built once per storage (the row tensors are allocated once and only written in place, so their
addresses are stable). Groups of one layer live in separate tensors of different shapes; a
kernel reaches group g through `rows_k_ptr[g]`, the address of `rows_k[l][g]`, cast to a
pointer in the kernel. Index spaces: group g in [0, G), member j in [0, H_p), KV head h in
[0, H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from sgl_ragged.mem_pool.storage import RaggedStorage

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype not in TL_DTYPES:
        raise TypeError(f"the ragged kernels support {list(TL_DTYPES)}, not {dtype}")
    return TL_DTYPES[dtype]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class LayerTables:
    """One layer's group structure as device tensors."""

    rows_k_ptr: torch.Tensor  # [G] int64 address of rows_k[l][g] ([pages, k_g, H_p, D])
    rows_v_ptr: torch.Tensor  # [G] int64 address of rows_v[l][g]
    slots: torch.Tensor  # [G] int32 k[l][g], row slots per logical page
    group_heads: torch.Tensor  # [G, H_p] int32 KV heads of each group
    head_group: torch.Tensor  # [H] int32 group of each KV head
    head_member: torch.Tensor  # [H] int32 position j of the head inside its group
    heads_per_group: int
    max_slots: int
    rows_dtype: torch.dtype

    @property
    def num_groups(self) -> int:
        return self.slots.numel()


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

    return LayerTables(
        rows_k_ptr=ptrs(storage.rows_k[layer]),
        rows_v_ptr=ptrs(storage.rows_v[layer]),
        slots=i32(slots),
        group_heads=i32(groups),
        head_group=i32(head_group),
        head_member=i32(head_member),
        heads_per_group=len(groups[0]),
        max_slots=max(slots),
        rows_dtype=storage.dtype,
    )


def all_layer_tables(storage: RaggedStorage) -> list[LayerTables]:
    return [layer_tables(storage, layer) for layer in range(storage.layout.num_layers)]
