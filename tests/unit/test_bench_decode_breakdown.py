"""bench.decode_breakdown off the GPU: its options, the variants and split maps it measures, its
table, and a clean exit without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench import decode_breakdown as bd
from bench.decode_attention import HEAD_DIM, PAGE, synthetic_profile
from sgl_ragged.attention_backend.registry import profile_split_ratios
from sgl_ragged.kernels.aot import (
    MAX_PROGRAMS_PER_SM,
    SplitStrategy,
    cost_split_ratios,
    layout_split_ratios,
    split_plan,
)
from sgl_ragged.kernels.decode import DECODE_LAUNCH
from tests.unit.kernel_cases import make_storage

GPU_OPTIONS = ["--precision", "int4", "--batch", "4", "16", "64", "--context", "8192", "65536",
               "--programs-per-sm", "2", "4", "8", "--sweep", "shipped", "--splits", "uniform",
               "aot", "cost"]


def parse(argv: list[str]) -> bd.Variants:
    return bd.variants_of(bd.argument_parser().parse_args(argv))


def test_options_give_the_variants() -> None:
    assert parse(GPU_OPTIONS) == bd.Variants((2, 4, 8), (bd.SHIPPED,),
                                             ("uniform", "aot", "cost:1"))
    assert parse(["--programs-per-sm", "4", "4", "--sweep", "2:16", "shipped", "2:16:3",
                  "--splits", "cost:0.5", "cost:0"]) == bd.Variants(
        (4,), ((2, 16), bd.SHIPPED, (2, 16, 3)), ("cost:0.5", "cost:0"))


def test_defaults_are_servings_cap_the_sweep_and_aot_against_uniform() -> None:
    assert parse([]) == bd.Variants((MAX_PROGRAMS_PER_SM,), bd.SWEEP, ("aot", "uniform"))
    assert parse([]).pack == (False,)


def test_pack_times_packed_pages_beside_the_shipped_kernel() -> None:
    assert parse(["--pack", "off", "on", "on"]).pack == (False, True)
    assert parse(["--pack", "on"]).pack == (True,)
    with pytest.raises(SystemExit):
        bd.argument_parser().parse_args(["--pack", "yes"])


def test_packed_sets_the_kernels_switch_and_restores_it(monkeypatch) -> None:
    import os

    from sgl_ragged.kernels.launch import block_config, packed_pages
    from sgl_ragged.kernels.tables import layer_tables

    monkeypatch.delenv("RAGGED_TRITON_PACK", raising=False)
    profile = synthetic_profile(2)
    storage = make_storage(profile, PAGE, HEAD_DIM, 2, 1, torch.bfloat16, "cpu", "int4")
    q = torch.zeros(1, 4, HEAD_DIM, dtype=torch.bfloat16)
    cfg = block_config(q, 4, HEAD_DIM)
    tables = layer_tables(storage, 0)
    with bd.packed(True):
        assert packed_pages(q, tables, cfg) == 4  # 4 query heads a KV head: 4 pages a dot
    assert "RAGGED_TRITON_PACK" not in os.environ and packed_pages(q, tables, cfg) == 0
    drop = make_storage(profile, PAGE, HEAD_DIM, 2, 1, torch.bfloat16, "cpu", "bf16")
    with bd.packed(True):
        assert packed_pages(q, layer_tables(drop, 0), cfg) == 0  # no low tier: nothing to pack


@pytest.mark.parametrize("argv", [["--programs-per-sm", "0"], ["--programs-per-sm", "x"],
                                  ["--sweep", "3:16"], ["--sweep", "ship"],
                                  ["--sweep", "2:16:5"], ["--sweep", "2:16:1:1"],
                                  ["--splits", "bytes"], ["--splits", "aot:1"],
                                  ["--splits", "cost:"], ["--splits", "cost:-1"],
                                  ["--splits", "cost:x"]])
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bd.argument_parser().parse_args(argv)


def test_shipped_is_the_launch_of_the_rows() -> None:
    """SHIPPED is decode.DECODE_LAUNCH's launch; WARPS:BLOCK_N takes its stages."""
    variants = bd.Variants(sweep=(bd.SHIPPED, (2, 16), (1, 16), (4, 32), (2, 16, 4)))
    for precision, kind in (("bf16", "rows"), ("int4", "codes")):
        launches = variants.launches(precision)
        stages = DECODE_LAUNCH[kind][2]
        assert launches[0] == DECODE_LAUNCH[kind]
        assert sorted(launches) == sorted({DECODE_LAUNCH[kind], (2, 16, stages),
                                           (1, 16, stages), (4, 32, stages), (2, 16, 4)})
    assert variants.launches("int4", pack=True)[0] == DECODE_LAUNCH["packed"]


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_split_maps_are_the_named_ratios(precision: str) -> None:
    """uniform, aot (the profile's ratios drop-only, the layout's bytes quantized) and
    cost:F (aot.cost_split_ratios at the launch's BLOCK_N) on the benchmark's layout."""
    profile = synthetic_profile(2)
    storage = make_storage(profile, PAGE, HEAD_DIM, 2, 1, torch.bfloat16, "cpu", precision)
    layout, ctas = storage.layout, 264
    aot = layout_split_ratios(layout) if layout.quantized else profile_split_ratios(storage,
                                                                                     profile)
    want = {"uniform": split_plan(aot, ctas, "cpu", SplitStrategy.UNIFORM),
            "aot": split_plan(aot, ctas, "cpu"),
            "cost:0.5": split_plan(cost_split_ratios(layout, 32, 0.5), ctas, "cpu")}
    maps = {}
    for split, plan in want.items():
        got = bd.split_plan_of(split, storage, profile, ctas, 32)
        assert torch.equal(got.split_map, plan.split_map) and got.strategy == plan.strategy
        maps[split] = tuple(map(tuple, got.split_map.tolist()))
    assert len(set(maps.values())) == 3  # three different maps to time


def test_the_table_marks_what_serving_runs() -> None:
    def row(precision: str, strategy: str, per_sm: int, launch: tuple[int, int, int]) -> dict:
        return {"batch": 4, "context": 8192, "precision": precision, "programs_per_sm": per_sm,
                "num_ctas": 132 * per_sm, "warps": launch[0], "block_n": launch[1],
                "stages": launch[2],
                "strategy": strategy, "max_splits": 66, "eager_s": 2e-3, "graph_s": 1e-3,
                "graph_gbps": 900.0, "kernels_s": {"_sealed_splits_kernel_0d1d": 5e-4}}

    rows = [row("bf16", "aot", MAX_PROGRAMS_PER_SM, DECODE_LAUNCH["rows"]),
            row("bf16", "aot", MAX_PROGRAMS_PER_SM + 2, DECODE_LAUNCH["rows"]),
            row("int4", "uniform", MAX_PROGRAMS_PER_SM, DECODE_LAUNCH["codes"]),
            {**row("int4", "aot", MAX_PROGRAMS_PER_SM, DECODE_LAUNCH["codes"]),
             "graph_s": 2e-3},  # another split map: not the packed row's reference
            row("int4", "cost:1", MAX_PROGRAMS_PER_SM, DECODE_LAUNCH["codes"]),
            {**row("int4", "uniform", MAX_PROGRAMS_PER_SM, DECODE_LAUNCH["packed"]),
             "packed_pages": 4, "graph_s": 8e-4}]
    lines = bd.markdown(rows, "NVIDIA H200").splitlines()[4:]
    assert [line.endswith("| yes |") for line in lines] == [True, False, True, False, False,
                                                            False]
    assert "| int4 (packed) |" in lines[5]
    # the packed row against the unpacked one of its case and split map (uniform), side by side
    assert lines[5].endswith("| 0.80 | 900 | x0.80 |  |") and "| 1.00 | 900 |  | yes |" in lines[2]
    # its reference: the same split map, at the shipped unpacked launch where that ran
    packed = rows[5]
    others = [{**rows[3], "graph_s": 4e-3}, {**rows[2], "launch": [4, 32, 1], "graph_s": 4e-3},
              rows[2], packed]
    assert bd.unpacked_ratio(packed, others) == "x0.80"
    assert bd.unpacked_ratio(packed, [rows[3], packed]) == ""  # no unpacked uniform row ran
    assert bd.unpacked_ratio(rows[2], rows) == ""
    assert lines[4].startswith(f"| 4 | 8192 | int4 | {MAX_PROGRAMS_PER_SM} | ")
    assert "| cost:1 | 66 | 0.50 | 0.00 | 0.00 | 2.00 | 1.00 | 900 |" in lines[4]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_exits_cleanly_without_cuda(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.decode_breakdown", *GPU_OPTIONS,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "needs a CUDA device" in done.stdout, done.stderr
