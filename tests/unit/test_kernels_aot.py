"""AOT split map and per-forward kernel metadata: pure CPU, no kernel launches."""

from __future__ import annotations

import os
import random

import pytest
import torch

from sgl_ragged.budgets import split_map, split_ratios
from sgl_ragged.kernels.aot import (
    CPU_PARALLELISM,
    FOLD_TILES,
    SplitStrategy,
    cost_split_ratios,
    device_parallelism,
    layout_split_ratios,
    split_plan,
    uniform_split_map,
)
from sgl_ragged.kernels.batch import kernel_batch
from sgl_ragged.kernels.occupancy import KernelResources, SMLimits, programs_per_sm
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.scoring import SINK_TOKENS
from tests.conftest import USER_INTERPRET
from tests.unit.kernel_cases import P, Spec, random_plans, random_storage

BUDGETS = [[0.1, 0.9, 0.3, 0.3], [0.5, 0.5, 0.5, 0.5]]
GROUPS = [((0, 2), (1, 3)), ((0, 1), (2, 3))]


def test_aot_plan_is_algorithm_1():
    ratios = split_ratios(BUDGETS, GROUPS)
    plan = split_plan(ratios, 64, "cpu")
    assert plan.split_map.tolist() == [list(r) for r in split_map(BUDGETS, GROUPS, 64)]
    assert plan.split_map.dtype == torch.int32
    layer0 = plan.layer(0)
    assert layer0.split_counts.tolist() == [16, 48]
    assert layer0.num_work == 64 and layer0.max_splits == 48
    assert layer0.work_group.tolist() == [0] * 16 + [1] * 48
    assert layer0.work_split.tolist() == list(range(16)) + list(range(48))


def test_uniform_plan_gives_every_group_the_same_splits():
    plan = split_plan(split_ratios(BUDGETS, GROUPS), 64, "cpu", SplitStrategy.UNIFORM)
    assert plan.split_map.tolist() == [[32, 32], [32, 32]]
    assert uniform_split_map(1, 3, 10) == ((3, 3, 3),)
    assert uniform_split_map(1, 8, 2) == ((1,) * 8,)  # never zero splits


# ---- the cost-model split ratios (aot.cost_split_ratios) ---------------------------------------


def _kernel_tiles(tiers: RowTiers, quantized_high: bool, block_n: int, fold: float,
                  pages: int) -> float:
    """One head's tiles and folds over `pages` pages, loop by loop as attend.attend_sealed runs
    them: model-dtype high slots as one run of tiles across the pages, a quantized tier page by
    page (a fold, then its tiles)."""
    work = 0.0
    if quantized_high:
        for _ in range(pages if tiers.hi else 0):
            work += fold + len(range(0, tiers.hi, block_n))
    else:
        work += len(range(0, pages * tiers.hi, block_n))
    for _ in range(pages if tiers.lo else 0):
        work += fold + len(range(0, tiers.lo, block_n))
    return work


def _random_layout(rng: random.Random) -> RaggedLayout:
    """Random groups (1-4 of random sizes per layer), tiers and high-tier format; P = 64."""
    heads, groups, tiers = rng.choice([4, 6, 8]), [], []
    for _ in range(rng.randint(1, 3)):
        order = rng.sample(range(heads), heads)
        cuts = sorted(rng.sample(range(1, heads), rng.randint(0, 3)))
        groups.append(tuple(tuple(order[a:b]) for a, b in zip([0, *cuts], [*cuts, heads],
                                                               strict=True)))
        totals = [rng.randint(SINK_TOKENS, 64) for _ in groups[-1]]
        tiers.append(tuple(RowTiers(hi, t - hi) for t in totals
                           for hi in [rng.choice([0, t, rng.randint(0, t)])]))
    return RaggedLayout(page_size=64, head_dim=64, dtype_bytes=2, groups=tuple(groups),
                        slots=tuple(tuple(t.total for t in layer) for layer in tiers),
                        tiers=tuple(tiers), low=LOW_PRECISIONS["int4"],
                        high=rng.choice([None, LOW_PRECISIONS["int8"]]))


def test_cost_ratios_match_a_count_of_the_kernels_loops():
    """Over BLOCK_N pages (whole tiles of high slots), each group's share is its heads' counted
    tiles and folds over the layer's."""
    rng = random.Random(5)
    for _ in range(200):
        layout = _random_layout(rng)
        block_n, fold = rng.choice([16, 32, 64]), rng.choice([0.0, 0.5, 1.0, 3.0])
        high = layout.high is not None
        got = cost_split_ratios(layout, block_n, fold)
        for layer_groups, layer_tiers, ratios in zip(layout.groups, layout.tiers, got,
                                                     strict=True):
            work = [len(h) * _kernel_tiles(t, high, block_n, fold, block_n)
                    for h, t in zip(layer_groups, layer_tiers, strict=True)]
            assert ratios == pytest.approx([w / sum(work) for w in work]), (layout, block_n)


def test_cost_ratios_count_tiles_not_bytes():
    """Two int4 groups of 2 heads at BLOCK_N 16: 16 bf16 + 48 int4 slots cost 1 + (1 + 3) tiles,
    19 int4 slots 1 + 2; by bytes the first would take 5 / 6 of the splits."""
    tiers = ((RowTiers(16, 48), RowTiers(0, 19)),)
    layout = RaggedLayout(page_size=64, head_dim=128, dtype_bytes=2, groups=(((0, 1), (2, 3)),),
                          slots=((64, 19),), tiers=tiers, low=LOW_PRECISIONS["int4"])
    assert FOLD_TILES == 1.0
    assert cost_split_ratios(layout, 16)[0] == pytest.approx((5 / 8, 3 / 8))
    assert cost_split_ratios(layout, 16, fold_tiles=0.0)[0] == pytest.approx((4 / 6, 2 / 6))
    assert layout_split_ratios(layout)[0] == pytest.approx((30080 / 36120, 6040 / 36120))


def test_cpu_parallelism_is_fixed():
    assert device_parallelism("cpu") == CPU_PARALLELISM


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parallelism_counts_sms():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert device_parallelism("cuda", programs_per_sm=3) == 3 * sms


def test_kernel_batch_pads_page_tables():
    rng = random.Random(0)
    storage = random_storage(rng, "cpu")
    specs = [Spec(3, 9, 1), Spec(0, 0, 5), Spec(1, 2, 1)]
    plans = random_plans(storage, specs, rng, gap=1)
    batch = kernel_batch(plans, "cpu")
    assert batch.sealed_table.dtype == torch.int32 and batch.sealed_table.shape == (3, 3)
    assert batch.sealed_table[0].tolist() == plans[0].sealed_pages.tolist()
    assert batch.sealed_table[1].tolist() == [0, 0, 0]  # padded with the padding page
    assert batch.num_sealed.tolist() == [3, 0, 1]
    assert batch.stage_table.shape == (3, 2)  # 9 staged tokens = 2 pages of P = 8
    assert batch.stage_table[0].tolist() == plans[0].prior_stages.tolist()
    assert batch.num_staged.tolist() == [9, 0, 2]
    assert batch.q_start.tolist() == [1, 3, 9] and batch.q_len.tolist() == [1, 5, 1]
    assert (batch.max_q_len, batch.max_sealed) == (5, 3)
    assert P == 8


def test_kernel_batch_without_sealed_or_staged_pages():
    rng = random.Random(1)
    storage = random_storage(rng, "cpu")
    batch = kernel_batch(random_plans(storage, [Spec(0, 0, 4)], rng), "cpu")
    assert batch.sealed_table.shape == (1, 1) and batch.stage_table.shape == (1, 1)


def test_triton_interpret_is_not_left_in_the_environment():
    """tests/conftest.py sets it only while importing the kernels; e2e servers must not see it."""
    assert os.environ.get("TRITON_INTERPRET") == USER_INTERPRET


# ---- N_CTA from the compiled split kernel's resource use ---------------------------------------


def test_programs_per_sm_register_bound():
    """254 registers x 128 threads: 8192 registers per warp (256-register units), 2 programs."""
    used = KernelResources(registers_per_thread=254, shared_bytes=22 * 1024, num_warps=4)
    assert programs_per_sm(used, SMLimits()) == 2


def test_programs_per_sm_takes_the_tightest_limit():
    sm = SMLimits()
    # 32 registers, 4 warps: registers allow 16, threads 16 (2048 / 128), program cap 32.
    assert programs_per_sm(KernelResources(32, 0, 4), sm) == 16
    # Shared memory binds: (228 KiB) // (100 KiB + 1 KiB reserved) = 2.
    assert programs_per_sm(KernelResources(32, 100 * 1024, 4), sm) == 2
    # Tiny programs stop at the per-SM program cap.
    assert programs_per_sm(KernelResources(16, 0, 1), sm) == 32
    # Register rounding: 129 registers -> 4352 per warp -> 15 warps -> 3 programs of 4 warps.
    assert programs_per_sm(KernelResources(129, 0, 4), sm) == 3
    # A program that does not fit by the arithmetic still counts as one.
    assert programs_per_sm(KernelResources(255, 300 * 1024, 32), sm) == 1


def test_programs_per_sm_matches_a_brute_force_count():
    """Add programs one by one until a resource runs out."""
    rng = random.Random(3)
    sm = SMLimits()
    for _ in range(200):
        used = KernelResources(rng.randint(1, 255), rng.choice([0, rng.randint(1, 120_000)]),
                               rng.choice([1, 2, 4, 8, 16]))
        n = 0
        while True:
            warp_regs = -(-used.registers_per_thread * 32 // 256) * 256
            regs = (n + 1) * used.num_warps * warp_regs
            threads = (n + 1) * used.num_warps * 32
            shared = (n + 1) * (used.shared_bytes + 1024) if used.shared_bytes else 0
            if (regs > sm.registers or threads > sm.threads or shared > sm.shared_bytes
                    or n + 1 > sm.max_programs):
                break
            n += 1
        assert programs_per_sm(used, sm) == max(1, n), used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling for a GPU needs CUDA")
def test_split_kernel_resources_are_read_from_its_build():
    from sgl_ragged.attention_backend.triton_impl import decode_parallelism
    from sgl_ragged.kernels.aot import MAX_PROGRAMS_PER_SM
    from sgl_ragged.kernels.decode import DECODE_LAUNCH, split_kernel_resources
    from sgl_ragged.kernels.tables import layer_tables
    from tests.unit.kernel_cases import GPU

    storage = random_storage(random.Random(0), "cuda", dtype=torch.bfloat16, shape=GPU)
    ratios = [[1 / 4] * 4]
    tables = layer_tables(storage, 0)
    used = split_kernel_resources(tables, split_plan(ratios, 1, "cuda").layer(0),
                                  GPU.kv_heads * GPU.gqa, GPU.head_dim, torch.bfloat16)
    assert 0 < used.registers_per_thread <= 255 and used.num_warps == DECODE_LAUNCH["rows"][0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_ctas = decode_parallelism(storage, tables, ratios, GPU.kv_heads * GPU.gqa)
    resident = programs_per_sm(used, SMLimits.of("cuda"))
    assert num_ctas == sms * min(resident, MAX_PROGRAMS_PER_SM)
    for cap in (1, 4, 8):  # another cap (bench.decode_breakdown --programs-per-sm)
        assert decode_parallelism(storage, tables, ratios, GPU.kv_heads * GPU.gqa,
                                  cap) == sms * min(resident, cap)


@pytest.mark.parametrize("precision,rows", [("bf16", "rows"), ("int4", "codes"), ("fp8", "codes"),
                                            ("int8+int4", "codes")])
def test_decode_launch_follows_the_rows(precision, rows):
    """Drop-only layouts take the "rows" launch, any quantized tier (a quantized high tier
    too) the "codes" one; under the interpreter BLOCK_N stays block_config's."""
    from sgl_ragged.kernels.decode import DECODE_LAUNCH, decode_launch
    from sgl_ragged.kernels.launch import block_config
    from sgl_ragged.kernels.tables import layer_tables

    storage = random_storage(random.Random(3), "cpu", layers=3, dtype=torch.bfloat16,
                             precision=precision)
    d = storage.layout.head_dim
    q = torch.zeros(1, 8, d, dtype=torch.bfloat16)
    assert storage.layout.quantized == (rows == "codes")
    for layer in range(3):
        cfg, warps, stages = decode_launch(q, layer_tables(storage, layer), 2, d)
        assert (warps, stages) == (DECODE_LAUNCH[rows][0], DECODE_LAUNCH[rows][2])
        assert cfg == block_config(q, 2, d)
