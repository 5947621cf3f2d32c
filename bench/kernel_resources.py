"""What the Triton kernels occupy on a GPU, measured without one: registers, spills, stack and
shared memory per program as compiled for an NVIDIA architecture, and the programs per SM that
the AOT split map's N_CTA follows from (kernels/occupancy.py).

    python -m bench.kernel_resources [--arch 90] [--head-dim 64 128] \
        [--precision bf16 int8 int4 int2 fp8] [--split-launch W:N:S] [--kernel "decode split"] \
        --out results/kernel_resources

Each kernel (decode split, tail and merge, extend, seal) is launched on a small case on the CPU with
its launch intercepted: Triton's own argument binder specializes the arguments (types, 16-byte
alignment) for the CUDA target, `triton.compile` builds it, and its `ptxas -v` run (ptxas ships
with Triton) reports registers and spills. Shapes: 8 KV heads, GQA 4, page size 64, bfloat16 rows.
A compile-time figure, not a timing: it shows whether a build spills and how many programs an
SM holds, and, from the SASS, what a tile of tokens costs: the instructions a warp issues per
key token in the largest innermost loop and their mix (`loop_mix`). `--split-launch` compiles the
decode split kernel at other warps, BLOCK_N and stages than decode.DECODE_LAUNCH's (the launches
`bench.decode_breakdown --sweep` times on a GPU). Must run without TRITON_INTERPRET (the kernels
would be interpreted, not compiled). Writes kernel_resources.json and kernel_resources.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_ragged.precision import PAIR_CHOICES, PRECISION_CHOICES

KERNEL_NAMES = ("decode split", "decode tail", "decode merge", "extend", "seal")

HEADS, GQA, PAGE = 8, 4, 64


@dataclass(frozen=True)
class Build:
    """One kernel as compiled for the target."""

    kernel: str
    precision: str
    head_dim: int
    num_warps: int
    registers: int  # per thread
    spill_bytes: int  # spill stores + loads per thread
    stack_bytes: int
    shared_bytes: int
    programs_per_sm: int
    instructions: int  # SASS instructions of the whole kernel (nvdisasm)
    int_to_float: int  # I2F: a quarter of the float rate on an H100
    byte_loads: int  # 1-byte global loads (LDG .U8 / .S8)
    half_loads: int  # 2-byte global loads (LDG .U16 / .S16)
    wide_loads: int  # 16-byte global loads (LDG .128, and cp.async LDGSTS .128)
    inner_loops: list[int]  # SASS instructions of each innermost loop body (distinct, largest first)
    loop_mix: dict[str, int]  # the largest innermost loop's instructions by class (OP_CLASSES)
    block_n: int  # key tokens per tile (BLOCK_N as launched, times the pages a packed split
    # kernel attends at once; 0 without one)
    warp_instructions_per_token: float  # largest innermost loop x warps / block_n (0: no loop)


@dataclass(frozen=True)
class Launch:
    """A kernel launch as the host code made it (args, keyword options)."""

    fn: object  # the triton JITFunction
    args: tuple
    kwargs: dict


@contextmanager
def intercepted(kernels: dict[str, object]) -> Iterator[dict[str, Launch]]:
    """Launches of these JIT functions are recorded (by name) instead of run; GPU builds are
    chosen although the tensors live on the CPU (launch.compiled_for_gpu)."""
    from sgl_ragged.kernels import decode, extend, launch

    seen: dict[str, Launch] = {}
    saved = {name: fn.run for name, fn in kernels.items()}
    gpu_saved = launch.compiled_for_gpu, decode.compiled_for_gpu, extend.compiled_for_gpu

    def recorder(name: str, fn: object) -> Callable[..., None]:
        def run(*args, grid, warmup, **kwargs) -> None:
            seen[name] = Launch(fn, args, kwargs)
        return run

    for name, fn in kernels.items():
        fn.run = recorder(name, fn)
    decode.compiled_for_gpu = extend.compiled_for_gpu = launch.compiled_for_gpu = lambda x: True
    try:
        yield seen
    finally:
        for name, fn in kernels.items():
            fn.run = saved[name]
        launch.compiled_for_gpu, decode.compiled_for_gpu, extend.compiled_for_gpu = gpu_saved


def compile_launch(launch: Launch, arch: int) -> tuple[dict[str, int], int, str]:
    """Register, spill and stack use per thread (`ptxas -v` as Triton runs it), shared memory
    per program and the SASS (nvdisasm, which ships with Triton) of a recorded launch compiled
    for CUDA sm_<arch>, specialized as the JIT would specialize it on that target."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound,
                                                          specialization, options)
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log, knobs.cache.dir
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        # A fresh cache: a cached build (this process's or another's) runs no ptxas, so it
        # prints no log.
        knobs.nvidia.dump_ptxas_log, knobs.cache.dir = True, cache
        try:
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
        finally:
            knobs.nvidia.dump_ptxas_log, knobs.cache.dir = saved
    return ptxas_usage(log.getvalue()), kernel.metadata.shared, disassemble(kernel.asm["cubin"])


def disassemble(cubin: bytes) -> str:
    """SASS of a cubin, by the nvdisasm that ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*)$")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def sass_counts(sass: str) -> dict[str, object]:
    """Instruction counts of a kernel's SASS (every instruction once, however often it runs):
    all, int-to-float conversions, global loads by width, and the size of each innermost loop
    (a backward branch's body that holds no other; the tile loops, whose size is the work of
    one tile of tokens per thread)."""
    ops, labels, branches = [], {}, []
    for line in sass.splitlines():
        if found := LABEL.match(line):
            labels[found.group(1)] = len(ops)
        elif found := SASS_LINE.match(line):
            if found.group(2) == "BRA" and (target := re.search(r"\.L_x_\d+", found.group(3))):
                branches.append((len(ops), target.group(0)))
            ops.append(found.group(2))
    loops = [(labels[t], i) for i, t in branches if t in labels and labels[t] < i]
    inner = [(start, end) for start, end in loops
             if not any(start <= s0 and e0 <= end and (s0, e0) != (start, end) for s0, e0 in loops)]
    largest = max(inner, key=lambda loop: loop[1] - loop[0], default=None)
    loads = [op for op in ops if op.startswith(("LDG.", "LDGSTS."))]
    return {"instructions": len(ops),
            "int_to_float": sum(op.split(".")[0] == "I2F" for op in ops),
            "byte_loads": sum(op.endswith((".U8", ".S8")) for op in loads),
            "half_loads": sum(op.endswith((".U16", ".S16")) for op in loads),
            "wide_loads": sum(op.endswith(".128") for op in loads),
            "inner_loops": sorted({end - start + 1 for start, end in inner}, reverse=True),
            "loop_mix": op_mix(ops[largest[0]:largest[1] + 1]) if largest else {}}


OP_CLASSES = {
    "mma": ("HMMA", "HGMMA", "IMMA", "QGMMA"),  # tensor cores
    "bits": ("PRMT", "LOP3", "SHF"),  # byte permutes, logic and shifts: unpacking, packing pairs
    "move": ("MOV", "IMAD.MOV", "CS2R"),  # register copies (IMAD.MOV is ptxas's move)
    "float": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "MUFU", "HADD2", "HMUL2",
              "HFMA2", "F2F", "F2FP", "FCHK"),
    "shared": ("LDS", "LDSM", "STS", "STSM", "BAR"),  # shared memory: layout conversions
    "shuffle": ("SHFL",),  # warp reductions
    "global": ("LDG", "LDGSTS", "STG"),
}
"""Instruction classes of `op_mix`, matched on the opcode and its first modifier, longest
prefix first; the rest is "int" (addresses, indices, predicates, branches)."""


def op_mix(ops: list[str]) -> dict[str, int]:
    """Counts of SASS opcodes (with their modifiers, e.g. IMAD.MOV.U32) by OP_CLASSES."""
    names = sorted(((name, cls) for cls, names in OP_CLASSES.items() for name in names),
                   key=lambda item: -len(item[0]))
    counts = dict.fromkeys([*OP_CLASSES, "int"], 0)
    for op in ops:
        cls = next((c for name, c in names if op == name or op.startswith(name + ".")), "int")
        counts[cls] += 1
    return counts


def ptxas_usage(text: str) -> dict[str, int]:
    """Registers, spill bytes and stack bytes per thread from a `ptxas -v` log."""

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    if "registers" not in text:
        raise RuntimeError(f"no ptxas resource report in the compile log:\n{text}")
    return {"registers": number(r"Used (\d+) registers"),
            "spill_bytes": number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
            "stack_bytes": number(r"(\d+) bytes stack frame")}


def case_launches(precision: str, head_dim: int) -> dict[str, Launch]:
    """Launches of the four kernels for one small decode / extend / seal case on the CPU."""
    from sgl_ragged import budgets as bm
    from sgl_ragged.attention_backend.plan import RequestPlan
    from sgl_ragged.kernels import decode, extend, seal
    from sgl_ragged.kernels.aot import split_plan
    from sgl_ragged.kernels.batch import kernel_batch
    from sgl_ragged.kernels.tables import layer_tables
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.mem_pool.storage import RaggedStorage
    from sgl_ragged.profile import BudgetProfile
    from sgl_ragged.scoring import SnapKVScorer

    budgets = [[0.3, 0.1, 0.5, 0.2, 0.9, 0.3, 0.15, 0.4]]
    groups = [bm.cluster_heads(budgets[0], 2)]
    profile = BudgetProfile(None, budgets, groups, {"kind": "uniform"})
    layout = RaggedLayout.from_profile(profile, PAGE, head_dim, 2, precision=precision)
    storage = RaggedStorage(layout, 9, 2, torch.bfloat16, "cpu", SnapKVScorer())
    tables = layer_tables(storage, 0)
    plans = [RequestPlan(q_start=0, prefix=4 * PAGE + 9, seq_len=4 * PAGE + 10,
                         tail_start=4 * PAGE, sealed_pages=torch.arange(1, 5),
                         prior_stages=torch.tensor([0]), tail_pages=torch.tensor([5]), num_seal=0,
                         after_stages=torch.tensor([0]), tail_obs=torch.zeros(10), obs_queries=1)]
    batch = kernel_batch(plans, "cpu")
    q = torch.zeros(1, HEADS * GQA, head_dim, dtype=torch.bfloat16)
    kv = torch.zeros(1, HEADS, head_dim, dtype=torch.bfloat16)
    splits = split_plan(bm.split_ratios(budgets, groups), 264, "cpu").layer(0)
    names = dict(zip(KERNEL_NAMES, (decode._sealed_splits_kernel, decode._tail_kernel,
                                    decode._merge_kernel, extend._extend_kernel,
                                    seal._seal_kernel), strict=True))
    with intercepted(names) as seen:
        stage_k, stage_v = storage.stage_k[0], storage.stage_v[0]
        decode.decode_attention(q, kv, kv, stage_k, stage_v, tables, splits, batch, 1.0)
        extend.extend_attention(q, kv, kv, stage_k, stage_v, tables, batch, 1.0)
        src = torch.zeros(1, PAGE, HEADS, head_dim, dtype=torch.bfloat16)
        seal.seal_pages(tables, src, src, torch.tensor([0]), torch.tensor([5]),
                        torch.zeros(1, HEADS, PAGE), torch.zeros(1, PAGE, dtype=torch.bool))
    return seen


@contextmanager
def split_launch(launch: tuple[int, int, int] | None) -> Iterator[None]:
    """decode.DECODE_LAUNCH's (warps, BLOCK_N, stages) replaced by `launch` for every row layout
    (None: as shipped). launch.joined_safe still raises BLOCK_N where it must."""
    from sgl_ragged.kernels import decode

    saved = dict(decode.DECODE_LAUNCH)
    if launch is not None:
        decode.DECODE_LAUNCH.update(dict.fromkeys(saved, launch))
    try:
        yield
    finally:
        decode.DECODE_LAUNCH.update(saved)


def parse_launch(text: str) -> tuple[int, int, int]:
    """W:N:S (split-kernel warps, BLOCK_N, pipelining stages) as a tuple."""
    try:
        warps, block_n, stages = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected W:N:S, e.g. 2:32:1") from None
    if warps not in (1, 2, 4, 8) or block_n < 16 or block_n & (block_n - 1) or stages < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: warps 1, 2, 4 or 8, BLOCK_N a power of two of at least 16, stages >= 1")
    return warps, block_n, stages


def measure(precision: str, head_dim: int, arch: int,
            split: tuple[int, int, int] | None = None,
            kernels: Sequence[str] = KERNEL_NAMES) -> list[Build]:
    """The builds of `kernels` (names of KERNEL_NAMES) for rows of `precision`."""
    from sgl_ragged.kernels.occupancy import KernelResources, SMLimits, programs_per_sm

    builds = []
    with split_launch(split):
        launches = case_launches(precision, head_dim)
    for name, launch in launches.items():
        if name not in kernels:
            continue
        usage, shared, sass = compile_launch(launch, arch)
        warps = launch.kwargs.get("num_warps", 4)
        per_sm = programs_per_sm(KernelResources(usage["registers"], shared, warps), SMLimits())
        counts = sass_counts(sass)
        # Key tokens per pass of the tile loop: BLOCK_N, of each of BLOCK_G // GP pages where
        # the split kernel packs pages (launch.packed_pages, RAGGED_TRITON_PACK=1).
        gp = int(launch.kwargs.get("GP", 0))
        block_n = int(launch.kwargs.get("BLOCK_N", 0)) * (
            int(launch.kwargs["BLOCK_G"]) // gp if gp else 1)
        loop = counts["inner_loops"][0] if counts["inner_loops"] else 0
        per_token = round(loop * warps / block_n, 1) if block_n else 0.0
        builds.append(Build(name, precision, head_dim, warps, usage["registers"],
                            usage["spill_bytes"], usage["stack_bytes"], shared, per_sm,
                            **counts, block_n=block_n, warp_instructions_per_token=per_token))
        print(f"{precision} D={head_dim} {name}: {usage['registers']} registers, "
              f"{usage['spill_bytes']} B spilled, {per_sm} programs/SM", file=sys.stderr)
    return builds


def markdown(builds: list[Build], arch: int) -> str:
    lines = [f"Triton kernels compiled for sm_{arch} (no GPU needed): per thread registers, "
             "spilled bytes (stores + loads) and stack; shared memory per program; programs one "
             "SM holds (kernels/occupancy.py, sm_90 limits); SASS instructions (each counted "
             "once), int-to-float conversions, global loads 1, 2 and 16 bytes wide, and the "
             "instructions of each innermost loop (per thread per tile of BLOCK_N tokens), and "
             "the largest one's instructions a warp issues per key token.", "",
             "| kernel | rows | head_dim | warps | BLOCK_N | registers | spilled B | stack B "
             "| shared B | programs/SM | SASS | I2F | 1-B loads | 2-B loads | 16-B loads "
             "| inner loops | warp instructions per token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in builds:
        lines.append(f"| {b.kernel} | {b.precision} | {b.head_dim} | {b.num_warps} | "
                     f"{b.block_n or '-'} | {b.registers} | {b.spill_bytes} | {b.stack_bytes} | "
                     f"{b.shared_bytes} | {b.programs_per_sm} | {b.instructions} | "
                     f"{b.int_to_float} | {b.byte_loads} | {b.half_loads} | {b.wide_loads} | "
                     f"{' / '.join(map(str, b.inner_loops)) or '-'} | "
                     f"{b.warp_instructions_per_token or '-'} |")
    classes = [*OP_CLASSES, "int"]
    lines += ["", "The largest innermost loop by instruction class (per thread per tile; "
              "bench.kernel_resources.OP_CLASSES):", "",
              "| kernel | rows | head_dim | " + " | ".join(classes) + " |",
              "|---|---|---|" + "---|" * len(classes)]
    for b in builds:
        if b.loop_mix:
            lines.append(f"| {b.kernel} | {b.precision} | {b.head_dim} | "
                         + " | ".join(str(b.loop_mix[c]) for c in classes) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--precision", nargs="+", choices=[*PRECISION_CHOICES, *PAIR_CHOICES],
                        default=list(PRECISION_CHOICES))
    parser.add_argument("--split-launch", type=parse_launch, metavar="W:N:S",
                        help="the decode split kernel's warps, BLOCK_N and pipelining stages "
                             "for every precision (default: decode.DECODE_LAUNCH)")
    parser.add_argument("--kernel", nargs="+", choices=KERNEL_NAMES, default=list(KERNEL_NAMES),
                        help="compile only these kernels (default: all of them)")
    parser.add_argument("--out", type=Path, default=Path("results/kernel_resources"))
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    builds = [b for d in args.head_dim for p in args.precision
              for b in measure(p, d, args.arch, args.split_launch, args.kernel)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_resources.json").write_text(
        json.dumps({"arch": args.arch, "split_launch": args.split_launch,
                    "builds": [asdict(b) for b in builds]}, indent=2))
    table = markdown(builds, args.arch)
    (args.out / "kernel_resources.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
