"""What every kernel launcher shares: block sizes and the row layout the kernels assume."""

from __future__ import annotations

import os

import torch
import triton.language as tl

from sgl_ragged.kernels.quant import code_offset
from sgl_ragged.kernels.tables import LayerTables, next_pow2, tl_dtype


def compiled_for_gpu(x: torch.Tensor) -> bool:
    """Whether kernels launched for tensors like x are GPU builds (tensor-core block sizes, dots
    in the model dtype, native fp8 conversion) rather than the CPU interpreter's small float32
    ones. bench.kernel_resources patches it to compile GPU builds on a machine without a GPU."""
    return x.is_cuda


def native_level(q: torch.Tensor, tables: LayerTables, block_n: int, d: int, warps: int) -> int:
    """The kernels' NATIVE for a launch: 0 in the interpreter (fp8 decoded with integer
    arithmetic, codes unpacked with Triton's integer ops); 1 on a GPU (native fp8 conversion);
    2 on a GPU where integer code planes also unpack in PTX (quant._int_planes: the codes that
    enter 16-bit dots by their bits, quant.code_offset). The PTX packs 4 codes a register, so
    it needs every thread of the program to hold a multiple of 4 of a tile's
    [block_n, D * bits / 8] code bytes: with power-of-two sizes, at least 4 each.
    RAGGED_TRITON_PTX=0 keeps a GPU build at 1 (to tell a fault of the PTX from others)."""
    if not compiled_for_gpu(q):
        return 0
    if os.environ.get("RAGGED_TRITON_PTX", "1") == "0":
        return 1
    dot = tl_dtype(q.dtype)
    bits = [t.bits for t in (tables.low, tables.high)
            if t is not None and code_offset(t.bits, t.is_float, dot)]  # unpacked by their bits
    return 2 if all(block_n * d * b // 8 >= 4 * 32 * warps for b in bits) else 1


def packed_pages(q: torch.Tensor, tables: LayerTables, cfg: dict[str, object]) -> int:
    """The decode split kernel's GP: 0 attends a low tier page by page; GP > 0 (the query
    heads of a KV head, padded to a power of two) has BLOCK_G // GP pages of it attended at
    once, one per repeat of the GP heads' rows (attend._attend_low_packed), so that the rows
    a 16-bit dot pads to are used. Opt-in, RAGGED_TRITON_PACK=1, until a GPU has timed it;
    needs a low tier attended on joined codes (not split_planes) and at least 2 repeats."""
    if os.environ.get("RAGGED_TRITON_PACK", "0") != "1" or tables.low is None:
        return 0
    if split_planes(q, tables, int(cfg["D"])):
        return 0
    gp = next_pow2(int(cfg["GSIZE"]))
    return gp if int(cfg["BLOCK_G"]) // gp >= 2 else 0


JOINED_MIN_K = 32
"""The shortest reduction a 16-bit dot on joined code planes gets on a GPU (`joined_safe`)."""


def _plane_tiers(tables: LayerTables) -> list:
    """The tables' tiers of 2- or 4-bit integer codes (stored as bit planes)."""
    return [t for t in (tables.low, tables.high) if t is not None and not t.is_float and t.bits < 8]


def split_planes(q: torch.Tensor, tables: LayerTables, d: int) -> bool:
    """The kernels' PLANES: attend 2- and 4-bit tiers one dot per bit plane
    (attend._attend_code_pages) instead of on joined planes. Opt-in, RAGGED_TRITON_PLANES=1,
    until a GPU has compared both (session 18); needs every such tier's planes at least 16
    channels wide (D * bits / 8, a dot's smallest side)."""
    if os.environ.get("RAGGED_TRITON_PLANES", "0") != "1":
        return False
    tiers = _plane_tiers(tables)
    return bool(tiers) and all(d * t.bits // 8 >= 16 for t in tiers)


def joined_planes(q: torch.Tensor, tables: LayerTables) -> bool:
    """Whether a GPU build for these tables multiplies 16-bit dot operands made of joined bit
    planes: 2- and 4-bit integer codes, unpacked plane by plane and put together with tl.join
    and reshape (quant.low_codes), in a bfloat16 or float16 model (not with split_planes)."""
    if not compiled_for_gpu(q) or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    return bool(_plane_tiers(tables)) and not split_planes(q, tables, q.shape[-1])


def joined_safe(cfg: dict[str, object], q: torch.Tensor, tables: LayerTables) -> dict[str, object]:
    """cfg (block_config's, BLOCK_N as launched) with every 16-bit dot on joined code planes
    reducing over at least JOINED_MIN_K. On an H100 with Triton 3.6 (session 18) such a dot
    came out wrong whenever the joined operand's reduction side was 16 long, PTX unpacking or
    not, at 1, 2 and 4 warps, with or without code_offset: the values' dot at BLOCK_N 16
    (p [G, 16] x codes [16, D]), the keys' dot at D = 16 (q [G, 16] x codes^T [16, N]); the
    same kernels at BLOCK_N 32 and D = 128 matched the reference, as did float32 dots (FMA)
    at every shape and dots on codes no join built (int8, fp8) or unpacked alone. So BLOCK_N is
    raised to JOINED_MIN_K, and heads below it take float32 dots."""
    if not joined_planes(q, tables):
        return cfg
    cfg = {**cfg, "BLOCK_N": max(int(cfg["BLOCK_N"]), JOINED_MIN_K)}
    if int(cfg["D"]) < JOINED_MIN_K:
        cfg.update(DOT=tl.float32, PRECISION="ieee")
    return cfg


def block_config(q: torch.Tensor, gsize: int, d: int) -> dict[str, object]:
    """Block sizes: tensor-core friendly on a GPU, tiny under the CPU interpreter (BLOCK_N 32:
    with 64 the sm_90 build of the split kernel spills registers at D = 128). Dot operands are
    in q's dtype everywhere, so the interpreter rounds what a GPU build rounds (queries with
    their scales folded in, probabilities); float32 dots are exact (no TF32). The
    interpreter's own 16-bit matmul is not numeric: PRECISION "emulate" has attend.mma
    multiply 16-bit operands as their float32 values there, as a tensor core does (exact
    products, float32 sums)."""
    gpu = compiled_for_gpu(q)
    dot = tl_dtype(q.dtype)
    return {
        "GSIZE": gsize, "D": d, "BLOCK_G": max(16, next_pow2(gsize)),
        "BLOCK_N": 32 if gpu else 16, "BLOCK_D": max(16, next_pow2(d)),
        "DOT": dot, "PRECISION": "ieee" if dot == tl.float32 else "tf32" if gpu else "emulate",
    }


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels assume head stride D and unit element stride; copy only if not."""
    d = x.shape[-1]
    return x if x.stride(-1) == 1 and x.stride(-2) == d else x.contiguous()
