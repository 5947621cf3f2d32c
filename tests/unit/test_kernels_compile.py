"""Every Triton kernel compiles for an H100 (sm_90) on this machine, for every row precision,
and the attention kernels' SASS loads rows and codes 16 bytes wide and converts no codes with
int-to-float instructions.

Triton's interpreter runs code the GPU compiler refuses (DEVELOPERS.md: a pointer type bound
to a local variable passed the CPU tests and failed on the H100), so the interpreter tests
alone do not show that a kernel builds. bench.kernel_resources compiles each kernel as the JIT
would for sm_90, with ptxas, in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernel_resources import KERNEL_NAMES
from sgl_ragged.precision import PRECISION_CHOICES

PRECISIONS = [*PRECISION_CHOICES, "int8+int4", "fp8+int2", "int8+fp8"]  # pairs: a quantized high tier

ROOT = Path(__file__).parents[2]


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--arch", "90", "--head-dim", "64",
         "--precision", *PRECISIONS, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    builds = json.loads((tmp_path / "kernel_resources.json").read_text())["builds"]
    built = {(b["kernel"], b["precision"]) for b in builds}
    assert built == {(k, p) for k in KERNEL_NAMES for p in PRECISIONS}
    for b in builds:
        assert 0 < b["registers"] <= 255, b
        assert b["programs_per_sm"] >= 1, b
        if b["inner_loops"]:  # the mix is of the largest loop, every instruction in one class
            assert sum(b["loop_mix"].values()) == b["inner_loops"][0], b
    # What the attention kernels spend per token (bench.kernel_resources's SASS counts):
    by = {(b["kernel"], b["precision"]): b for b in builds}
    for kernel in ("decode split", "extend"):
        for precision in PRECISIONS:
            b = by[kernel, precision]
            # Code bytes arrive 16 at a time (quant.table_ptr's alignment), never one by one.
            assert b["byte_loads"] == 0, b
            # Without an int8 tier, codes become bfloat16 numbers by their bits
            # (quant.code_offset): a few int-to-float conversions for scalars, as drop-only,
            # none per code (a tile gives each thread at least 32 codes to convert).
            if "int8" not in precision:
                assert b["int_to_float"] < 16, b
    # Drop-only rows too arrive 16 bytes at a time, not 2.
    assert by["decode split", "bf16"]["half_loads"] == 0
    assert by["decode split", "bf16"]["wide_loads"] > 0


def test_split_launch_compiles_the_split_kernel_as_asked(tmp_path):
    from bench.kernel_resources import parse_launch

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--head-dim", "64", "--precision",
         "bf16", "int4", "--split-launch", "2:64:1", "--kernel", "decode split", "--out",
         str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((tmp_path / "kernel_resources.json").read_text())
    assert report["split_launch"] == [2, 64, 1]
    split = report["builds"]
    assert {b["kernel"] for b in split} == {"decode split"}
    assert [(b["precision"], b["num_warps"], b["block_n"]) for b in split] == [
        ("bf16", 2, 64), ("int4", 2, 64)]
    for b in split:  # a warp's instructions per key token: the tile loop x warps / BLOCK_N
        assert b["warp_instructions_per_token"] == round(b["inner_loops"][0] * 2 / 64, 1) > 0
    assert "warp instructions per token" in (tmp_path / "kernel_resources.md").read_text()
    assert parse_launch("1:32:2") == (1, 32, 2)
    for bad in ("1:32", "3:32:1", "1:24:1", "1:32:0", "a:b:c"):
        with pytest.raises(argparse.ArgumentTypeError, match="W:N:S|warps"):
            parse_launch(bad)


def test_packed_pages_compile_for_sm90(tmp_path):
    """RAGGED_TRITON_PACK=1 (launch.packed_pages): the split kernel that attends several
    low-tier pages at once builds for sm_90 at decode.DECODE_LAUNCH["packed"], loads codes 16
    bytes wide, converts no 2- or 4-bit codes, and at 2 or 4 bits spills nothing at head size
    64; its tokens per tile count every packed page (BLOCK_N x 4 at GQA 4)."""
    from sgl_ragged.kernels.decode import DECODE_LAUNCH

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAGGED_TRITON_PACK"] = "1"
    precisions = ["int4", "int2", "int8", "fp8", "int8+int4"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--head-dim", "64", "--precision",
         *precisions, "--kernel", "decode split", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    builds = json.loads((tmp_path / "kernel_resources.json").read_text())["builds"]
    assert {b["kernel"] for b in builds} == {"decode split"}  # --kernel: the one packing changes
    split = {b["precision"]: b for b in builds}
    assert set(split) == set(precisions)
    warps, block_n, _ = DECODE_LAUNCH["packed"]
    for precision, b in split.items():
        assert b["num_warps"] == warps and b["block_n"] == block_n * 4, b
        assert b["byte_loads"] == 0 and b["wide_loads"] > 0, b
        if "int8" not in precision:
            assert b["int_to_float"] < 16, b
        if precision in ("int4", "int2", "int8+int4"):
            assert b["spill_bytes"] == 0, b


def test_sass_counts_read_loads_conversions_and_inner_loops():
    from bench.kernel_resources import sass_counts

    sass = """
        /*0000*/                   LDG.E.U8 R1, desc[UR4][R2.64] ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
.L_x_1:
        /*0020*/                   I2F R5, R1 ;
        /*0030*/              @P0  BRA `(.L_x_1) ;
        /*0040*/                   LDG.E.U16 R6, desc[UR4][R2.64] ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0070*/                   EXIT ;
"""
    mix = {"mma": 0, "bits": 0, "move": 0, "float": 0, "shared": 0, "shuffle": 0, "global": 0,
           "int": 2}
    assert sass_counts(sass) == {"instructions": 8, "int_to_float": 1, "byte_loads": 1,
                                 "half_loads": 1, "wide_loads": 1, "inner_loops": [2],
                                 "loop_mix": mix}


def test_op_mix_classes_opcodes_by_their_first_modifier():
    from bench.kernel_resources import op_mix

    ops = ["HMMA.16816.F32.BF16", "PRMT", "LOP3.LUT", "SHF.R.U32.HI", "IMAD.MOV.U32", "MOV",
           "CS2R", "IMAD.SHL.U32", "IMAD.WIDE.U32", "F2FP.BF16.F32.PACK_AB", "MUFU.EX2",
           "FMUL", "LDSM.16.M88.4", "LDS.128", "STS.128", "BAR.SYNC.DEFER_BLOCKING",
           "SHFL.BFLY", "LDG.E.128", "LDGSTS.E.BYPASS.128", "ISETP.GE.AND", "BRA"]
    assert op_mix(ops) == {"mma": 1, "bits": 3, "move": 3, "float": 3, "shared": 4,
                           "shuffle": 1, "global": 2, "int": 4}


def test_native_level_unpacks_in_ptx_where_every_thread_holds_4_codes(monkeypatch):
    """0 in the interpreter; on a GPU build 2 where a tile of code bytes gives each thread of
    the program at least 4 (the PTX packs 4 a register), else 1; RAGGED_TRITON_PTX=0 gives 1."""
    import random

    import torch

    from sgl_ragged.kernels import launch
    from sgl_ragged.kernels.tables import layer_tables
    from tests.unit.kernel_cases import random_storage

    q = torch.zeros(1, 4, 32, dtype=torch.bfloat16)  # the codes enter the dots by their bits
    int2 = layer_tables(random_storage(random.Random(0), "cpu", precision="int2"), 0)
    drop = layer_tables(random_storage(random.Random(0), "cpu"), 0)
    assert launch.native_level(q, int2, 16, 64, 1) == 0
    monkeypatch.setattr(launch, "compiled_for_gpu", lambda x: True)
    assert launch.native_level(q, int2, 16, 64, 1) == 2  # 16 x 16 bytes over 32 threads: 8
    assert launch.native_level(q, int2, 32, 64, 8) == 1  # 32 x 16 bytes over 256 threads: 2
    assert launch.native_level(q, drop, 32, 64, 8) == 2  # no integer planes to unpack
    monkeypatch.setenv("RAGGED_TRITON_PTX", "0")
    assert launch.native_level(q, int2, 16, 64, 1) == 1


def test_joined_code_planes_reduce_over_at_least_32_on_a_gpu(monkeypatch):
    """launch.joined_safe (a 16-bit dot on joined 2- or 4-bit code planes came out wrong on an
    H100 when that operand's reduction side was 16 long): on a GPU build such tiers get
    BLOCK_N >= 32 and, with heads below 32, float32 dots; int8 and fp8 codes, drop-only rows,
    float32 models and the interpreter keep block_config's sizes."""
    import random

    import torch
    import triton.language as tl

    from sgl_ragged.kernels import launch
    from sgl_ragged.kernels.tables import layer_tables
    from tests.unit.kernel_cases import Shape, random_storage

    def tables(precision, d):
        return layer_tables(random_storage(random.Random(0), "cpu", precision=precision,
                                           shape=Shape(head_dim=d)), 0)

    def safe(precision, d, dtype=torch.bfloat16):
        q = torch.zeros(1, 4, d, dtype=dtype)
        cfg = {**launch.block_config(q, 2, d), "BLOCK_N": 16}
        return cfg, launch.joined_safe(cfg, q, tables(precision, d))

    cfg, got = safe("int4", 64)
    assert got == cfg  # the interpreter
    monkeypatch.setattr(launch, "compiled_for_gpu", lambda x: True)
    for precision in ("int4", "int2", "int8+int4", "fp8+int2"):
        cfg, got = safe(precision, 64)
        assert got == {**cfg, "BLOCK_N": 32}, precision
        cfg, got = safe(precision, 16)
        assert got == {**cfg, "BLOCK_N": 32, "DOT": tl.float32, "PRECISION": "ieee"}, precision
    for precision in ("bf16", "int8", "fp8"):
        cfg, got = safe(precision, 16)
        assert got == cfg, precision
    cfg, got = safe("int4", 16, torch.float32)
    assert got == cfg
    cfg = {**launch.block_config(torch.zeros(1, 4, 64), 2, 64), "BLOCK_N": 64}
    assert launch.joined_safe(cfg, torch.zeros(1, 4, 64, dtype=torch.float16),
                              tables("int2", 64))["BLOCK_N"] == 64  # never lowered
