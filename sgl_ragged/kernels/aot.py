"""Ahead-of-time load balancing: the static Workload Split Map S[l, g] (TANGRAM section 4.3).

At server start the profile's split ratios Phi[l,g] / Omega[l] and the device's parallelism
N_CTA (programs of the decode kernel that can be resident at once) give
S[l,g] = max(1, round(ratio * N_CTA)) (budgets.split_map_from_ratios, = Algorithm 1). The decode
kernel reads S and a per-layer work list; nothing is planned per step. The uniform baseline
gives every group the same split count (FlashDecoding's num_splits), for measurement. Ratios
come from the profile, from a layout's bytes per page (layout_split_ratios) or from a model of
the split kernel's tiles per page (cost_split_ratios, measured by bench.decode_breakdown only).

A decode launch has batch * sum_g S[l,g] programs; program (w, b) covers split work_split[w] of
group work_group[w] for request b: an equal share of that group's sealed tokens, all H_p heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

import torch

from sgl_ragged.budgets import split_map_from_ratios
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.tiers import RowTiers

CPU_PARALLELISM = 8
"""N_CTA used on a CPU (Triton interpreter, tests): a fixed small value, no meaning for speed."""

PROGRAMS_PER_SM = 2
"""Fallback for resident programs of the split kernel per SM, used where its build cannot be
inspected: its sm_80/sm_90 builds (4 warps, D = 128, BLOCK_N 32) use 254 registers per thread,
so 65536 / (128 * 254) = 2 fit (read with cuobjdump from builds made without a GPU). Serving
measures it at start from the compiled kernel (triton_impl.decode_parallelism, occupancy.py)."""

MAX_PROGRAMS_PER_SM = 2
"""Most resident programs per SM that N_CTA counts. The retuned split kernels (1-2 warps,
decode.DECODE_LAUNCH) fit 8-9 per SM, but each one more per SM adds splits to every group (the
split map is static: short contexts get empty splits) and partials for the merge to read. The
retuned builds were timed at 2 per SM (N_CTA 264 on an H200's 132 SMs, docs/results.md,
"Decode attention on an H200"); more was not measured."""


class SplitStrategy(str, Enum):
    AOT = "aot"  # S proportional to the group's budget (Algorithm 1)
    UNIFORM = "uniform"  # the same S for every group (FlashDecoding-style static split)


def device_parallelism(device: torch.device | str, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """N_CTA: SM count x resident programs per SM on CUDA, CPU_PARALLELISM elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_PARALLELISM
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm


@dataclass(frozen=True)
class LayerSplits:
    """One layer's slice of the split map plus its flattened work list (device tensors)."""

    split_counts: torch.Tensor  # [G] int32 S[l, g]
    work_group: torch.Tensor  # [W] int32 group of work item w, W = sum_g S[l, g]
    work_split: torch.Tensor  # [W] int32 split index of work item w within its group
    num_work: int  # W (host int: the grid size)
    max_splits: int  # max_g S[l, g] (host int: the partial-result buffer width)

    def of_groups(self, groups: Sequence[int] | None) -> LayerSplits:
        """The work items of these groups only (a launch per low format, tables.format_parts);
        split counts and buffer width stay the layer's. None: all."""
        if groups is None:
            return self
        keep = torch.isin(self.work_group, torch.tensor(list(groups), dtype=torch.int32,
                                                        device=self.work_group.device))
        work_group, work_split = self.work_group[keep], self.work_split[keep]
        return replace(self, work_group=work_group, work_split=work_split,
                       num_work=int(work_group.numel()))


@dataclass(frozen=True)
class SplitPlan:
    """The static Workload Split Map for all layers, built once at server start."""

    strategy: SplitStrategy
    num_ctas: int
    split_map: torch.Tensor  # [L, G] int32 S[l, g] on the device
    layers: tuple[LayerSplits, ...]

    def layer(self, layer: int) -> LayerSplits:
        return self.layers[layer]


def aot_split_map(ratios: Sequence[Sequence[float]], num_ctas: int) -> tuple[tuple[int, ...], ...]:
    """S[l][g] from the profile's split ratios (Algorithm 1 for this device)."""
    return split_map_from_ratios(ratios, num_ctas)


def uniform_split_map(num_layers: int, num_groups: int, num_ctas: int) -> tuple[tuple[int, ...], ...]:
    """Baseline: every group of every layer gets max(1, round(N_CTA / G)) splits."""
    n = max(1, int(num_ctas / num_groups + 0.5))
    return tuple(tuple(n for _ in range(num_groups)) for _ in range(num_layers))


def split_plan(ratios: Sequence[Sequence[float]], num_ctas: int, device: torch.device | str,
               strategy: SplitStrategy = SplitStrategy.AOT) -> SplitPlan:
    """The split map and work lists of `strategy` as device tensors."""
    strategy = SplitStrategy(strategy)
    if strategy is SplitStrategy.AOT:
        smap = aot_split_map(ratios, num_ctas)
    else:
        smap = uniform_split_map(len(ratios), len(ratios[0]), num_ctas)
    split_map = torch.tensor(smap, dtype=torch.int32, device=device)
    return SplitPlan(
        strategy=strategy,
        num_ctas=num_ctas,
        split_map=split_map,
        layers=tuple(_layer_splits(row, split_map[layer]) for layer, row in enumerate(smap)),
    )


def _layer_splits(counts: Sequence[int], row: torch.Tensor) -> LayerSplits:
    """Work items ordered group by group, split by split; `row` is S[l] on the device."""
    groups = [g for g, n in enumerate(counts) for _ in range(n)]
    splits = [s for n in counts for s in range(n)]

    def i32(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=row.device)

    return LayerSplits(split_counts=row, work_group=i32(groups), work_split=i32(splits),
                       num_work=len(groups), max_splits=max(counts))


def layout_split_ratios(layout: RaggedLayout) -> tuple[tuple[float, ...], ...]:
    """[L][G] work share of each group from the layout alone: the bytes of its rows one page
    holds (what the split kernel reads: hi slots at the model dtype or quantized, then the low tier's codes
    and parameters; k[l][g] * H_p slots without a low tier) over the layer's total. Used when
    no profile ratios are at hand (registry.profile_split_ratios; quantized layouts get equal
    shares there: this map lost to them on an H200, docs/results.md, "Decode attention on an
    H200")."""
    result = []
    for li, layer_groups in enumerate(layout.groups):
        work = [layout.group_bytes(li, g) for g in range(len(layer_groups))]  # each in its format
        result.append(tuple(w / sum(work) for w in work))
    return tuple(result)


FOLD_TILES = 1.0
"""cost_split_ratios' default cost of one page's fold (a quantized tier's key parameters folded
into the query, attend._attend_low_page step 1), in tiles of BLOCK_N tokens. Not measured:
`bench.decode_breakdown --splits cost:F` times other values."""


def cost_split_ratios(layout: RaggedLayout, block_n: int,
                      fold_tiles: float = FOLD_TILES) -> tuple[tuple[float, ...], ...]:
    """[L][G] work share of each group from a model of the split kernel's time per page
    (attend.attend_sealed), counted in tiles of block_n tokens for each of the group's H_p heads:

    - hi slots at the model dtype: hi / block_n (a split's high slots run as one sequence of
      tiles across its pages);
    - each quantized tier with slots (the low tier; a quantized high tier too, read page by
      page): fold_tiles for the page's fold, plus ceil(slots / block_n) tiles.

    A tile costs the same whatever it holds (on an H200 an int4 token took about as long as a
    model-dtype one, docs/results.md, "Decode attention on an H200"); a layer's shares are its
    groups' work over their sum. Not served: registry.profile_split_ratios gives quantized
    layouts equal shares until `bench.decode_breakdown --splits cost` has timed this map."""
    result = []
    for layer_groups, layer_tiers in zip(layout.groups, layout.tiers, strict=True):
        work = [len(heads) * _page_tiles(t, layout.high is not None, block_n, fold_tiles)
                for heads, t in zip(layer_groups, layer_tiers, strict=True)]
        result.append(tuple(w / sum(work) for w in work))
    return tuple(result)


def _page_tiles(tiers: RowTiers, quantized_high: bool, block_n: int, fold_tiles: float) -> float:
    """One head's modeled tiles per page of a group with these tiers (cost_split_ratios)."""

    def quantized(slots: int) -> float:
        return fold_tiles + -(-slots // block_n) if slots else 0.0

    high = quantized(tiers.hi) if quantized_high else tiers.hi / block_n
    return high + quantized(tiers.lo)
