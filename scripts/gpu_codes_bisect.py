"""Bisects a wrong result of the Triton kernels on code tiers, on a lent GPU (session 18).

    python3 scripts/gpu_codes_bisect.py micro             # interleave/planar, low_codes, q . codes^T
    python3 scripts/gpu_codes_bisect.py pv                # p . codes (the values' dot), K 16 and 32
    python3 scripts/gpu_codes_bisect.py seal mixed int4   # sealed state against torch's, by tensor
    [DIAG_LAUNCH=W,N,S] [DIAG_NOMAGIC=1] [RAGGED_TRITON_PTX=0] \\
        python3 scripts/gpu_codes_bisect.py decode int4 int2   # max error per request

`decode` runs the split kernel at the small test shapes and at serving shapes, uniform and AOT
splits, against torch_ref; DIAG_LAUNCH overrides decode.DECODE_LAUNCH (launch.joined_safe
still applies), DIAG_NOMAGIC=1 empties quant._MAGIC (codes converted, no code_offset). Run
variants as separate processes (in parallel: each compiles its own kernels). Under
TRITON_INTERPRET=1 `decode` and `seal` run on the CPU (small shapes); `micro` and `pv` need a
GPU's dots. docs/results.md, "The H100 run (session 18)", has what it found.
"""

from __future__ import annotations

import copy
import os
import random
import sys

import torch
import triton
import triton.language as tl

from sgl_ragged.kernels import decode as dec
from sgl_ragged.kernels import quant
from sgl_ragged.kernels.quant import interleaved, low_codes, planar

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _perm(X, Y, Z, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    y = interleaved(tl.load(X + offs), BITS, False, tl.bfloat16)
    tl.store(Y + offs, y)
    tl.store(Z + offs, planar(y, BITS, False, tl.bfloat16))


@triton.jit
def _codes(P, Y, M: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, NATIVE: tl.constexpr):
    CB: tl.constexpr = D * BITS // 8
    c = low_codes(tl.load(P + tl.arange(0, M)[:, None] * CB + tl.arange(0, CB)[None, :]),
                  M, D, BITS, False, NATIVE, tl.bfloat16)
    tl.store(Y + tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :], c.to(tl.float32))


@triton.jit
def _qk(Q, P, Out, R: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
        NATIVE: tl.constexpr):
    CB: tl.constexpr = D * BITS // 8
    q = interleaved(tl.load(Q + tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]),
                    BITS, False, tl.bfloat16)
    c = low_codes(tl.load(P + tl.arange(0, M)[:, None] * CB + tl.arange(0, CB)[None, :]),
                  M, D, BITS, False, NATIVE, tl.bfloat16)
    tl.store(Out + tl.arange(0, R)[:, None] * M + tl.arange(0, M)[None, :], tl.dot(q, tl.trans(c)))


@triton.jit
def _pv(Pp, C, Out, R: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
        NATIVE: tl.constexpr):
    CB: tl.constexpr = D * BITS // 8
    p = tl.load(Pp + tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :])
    c = low_codes(tl.load(C + tl.arange(0, K)[:, None] * CB + tl.arange(0, CB)[None, :]),
                  K, D, BITS, False, NATIVE, tl.bfloat16)
    tl.store(Out + tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :], tl.dot(p, c))


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar packing's codes in channel order (plane p = channels [p CB, (p + 1) CB))."""
    return torch.cat([(packed.int() >> (p * bits)) & ((1 << bits) - 1)
                      for p in range(8 // bits)], 1)


def _interleaved(x: torch.Tensor, bits: int) -> torch.Tensor:
    """quant.interleaved's channel order, in torch."""
    d = x.shape[1]
    if bits == 4:
        return x.reshape(-1, 2, d // 2).permute(0, 2, 1).reshape(-1, d)
    return x.reshape(-1, 2, 2, d // 4).permute(0, 3, 2, 1).reshape(-1, d)


def _report(name: str, run) -> None:
    try:
        print(f"{name}: {run()}", flush=True)
    except Exception as e:  # noqa: BLE001 (a bisection reports every failure and goes on)
        print(f"{name}: ERROR {type(e).__name__} {str(e)[:200]}", flush=True)


def micro() -> None:
    d = 128
    for bits in (4, 2):
        for w in (1, 2, 4):
            x = torch.randn(16, d, device=DEV).to(torch.bfloat16)
            y, z = torch.empty_like(x), torch.empty_like(x)
            _perm[(1,)](x, y, z, 16, d, bits, num_warps=w)
            print(f"perm bits{bits} w{w}: interleaved {torch.equal(y, _interleaved(x, bits))}, "
                  f"round trip {torch.equal(z, x)}", flush=True)
            for m in (16, 32):
                packed = torch.randint(0, 256, (m, d * bits // 8), device=DEV, dtype=torch.uint8)
                want = _interleaved(_unpack(packed, bits).float(), bits) + 128
                q = torch.randn(16, d, device=DEV).to(torch.bfloat16)
                for native in (1, 2):
                    def codes(packed=packed, want=want, native=native, m=m, bits=bits, w=w):
                        y = torch.empty(m, d, device=DEV)
                        _codes[(1,)](packed, y, m, d, bits, native, num_warps=w)
                        return f"max diff {(y - want).abs().max().item():.4g}"

                    def qk(packed=packed, q=q, native=native, m=m, bits=bits, w=w):
                        o = torch.empty(16, m, device=DEV)
                        _qk[(1,)](q, packed, o, 16, m, d, bits, native, num_warps=w)
                        ref = q.float() @ (_unpack(packed, bits).float() + 128).T
                        return f"max diff {(o - ref).abs().max().item():.4g} of {ref.abs().max().item():.4g}"

                    tag = f"bits{bits} w{w} M{m} native{native}"
                    _report(f"codes {tag}", codes)
                    _report(f"q.codes^T {tag}", qk)


def pv() -> None:
    d = 128
    for bits in (4, 2):
        for k in (16, 32):
            for w in (1, 4):
                for native in (1, 2):
                    def run(k=k, w=w, native=native, bits=bits):
                        packed = torch.randint(0, 256, (k, d * bits // 8), device=DEV,
                                               dtype=torch.uint8)
                        p = torch.rand(16, k, device=DEV).to(torch.bfloat16)
                        o = torch.empty(16, d, device=DEV)
                        _pv[(1,)](p, packed, o, 16, k, d, bits, native, num_warps=w)
                        ref = p.float() @ (_interleaved(_unpack(packed, bits).float(), bits) + 128)
                        return f"max diff {(o - ref).abs().max().item():.4g} of {ref.abs().max().item():.4g}"

                    _report(f"p.codes bits{bits} K{k} w{w} native{native}", run)


def seal(precisions: list[str]) -> None:
    from sgl_ragged.kernels.seal import seal_pages
    from sgl_ragged.kernels.tables import format_parts, layer_tables
    from sgl_ragged.scoring.select import sink_mask
    from tests.unit.kernel_cases import GPU, random_storage, storage_state

    for precision in precisions:
        rng, gen = random.Random(9), torch.Generator().manual_seed(9)
        storage = random_storage(rng, DEV, num_pages=256, dtype=torch.bfloat16, shape=GPU,
                                 precision=precision)
        oracle = copy.deepcopy(storage)
        n, p, h, d = 100, GPU.page_size, GPU.kv_heads, GPU.head_dim
        src_k = torch.randn(n, p, h, d, generator=gen).to(DEV, torch.bfloat16)
        src_v = torch.randn(n, p, h, d, generator=gen).to(DEV, torch.bfloat16)
        pages = torch.tensor(rng.sample(range(1, 256), n), device=DEV)
        start = p * torch.arange(n, device=DEV)
        scores = torch.rand(n, h, p, generator=gen).to(DEV)
        tables = layer_tables(storage, 0)
        seal_pages(tables, src_k, src_v, torch.arange(n, device=DEV).int(), pages.int(), scores,
                   sink_mask(start, p), format_parts(tables, storage.layout, 0))
        oracle.write_sealed(0, pages, src_k, src_v, oracle.sealer.choose(scores, start))
        for i, (got, want) in enumerate(zip(storage_state(storage), storage_state(oracle),
                                            strict=True)):
            if got.dtype == torch.uint8:
                print(f"seal {precision} tensor {i} {tuple(got.shape)}: codes differ "
                      f"{(got != want).float().mean().item():.5f}", flush=True)
            elif not torch.equal(got, want):
                bad = got != want
                first = tuple(bad.nonzero()[0].tolist())
                print(f"seal {precision} tensor {i} {tuple(got.shape)} {got.dtype}: "
                      f"{bad.sum().item()} differ, max abs "
                      f"{(got.float() - want.float()).abs().max().item():.4g}; first {first}: "
                      f"{got[first].item()} vs {want[first].item()}", flush=True)


def decode(precisions: list[str]) -> None:
    if os.environ.get("DIAG_NOMAGIC") == "1":
        quant._MAGIC.clear()
    if os.environ.get("DIAG_LAUNCH"):
        launch = tuple(int(x) for x in os.environ["DIAG_LAUNCH"].split(","))
        dec.DECODE_LAUNCH = dict.fromkeys(dec.DECODE_LAUNCH, launch)
    from sgl_ragged.attention_backend.torch_ref import request_forward
    from sgl_ragged.kernels.aot import SplitStrategy, device_parallelism, split_plan
    from sgl_ragged.kernels.batch import kernel_batch
    from sgl_ragged.kernels.tables import format_parts, layer_tables
    from tests.unit.kernel_cases import GPU, SMALL, Spec, random_plans, random_qkv, random_storage

    tag = (f"{os.environ.get('DIAG_LAUNCH', 'shipped')} "
           f"magic={'off' if os.environ.get('DIAG_NOMAGIC') == '1' else 'on'} "
           f"ptx={os.environ.get('RAGGED_TRITON_PTX', '1')}")
    cases = [("small", SMALL, [Spec(5, 3, 1), Spec(0, 0, 1), Spec(2, 8, 1), Spec(9, 13, 1)]),
             ("gpu", GPU, [Spec(100, 70, 1), Spec(3, 0, 1), Spec(0, 5, 1), Spec(250, 127, 1)])]
    for precision in precisions:
        for name, shape, specs in cases[: 2 if DEV == "cuda" else 1]:
            for strategy in (SplitStrategy.UNIFORM, SplitStrategy.AOT):
                def run(shape=shape, specs=specs, strategy=strategy, precision=precision):
                    rng = random.Random(21)
                    storage = random_storage(rng, DEV, num_pages=512, num_stages=16,
                                             dtype=torch.bfloat16, shape=shape,
                                             precision=precision)
                    plans = random_plans(storage, specs, rng)
                    q, k, v = random_qkv(plans, torch.Generator().manual_seed(21), DEV,
                                         torch.bfloat16, shape)
                    ratios = [[rng.random() for _ in range(shape.kv_heads // 2)]]
                    splits = split_plan(ratios, device_parallelism(DEV), DEV, strategy)
                    scale = shape.head_dim**-0.5
                    tables = layer_tables(storage, 0)
                    parts = [(t, splits.layer(0).of_groups(t.groups))
                             for t in format_parts(tables, storage.layout, 0)]
                    out, _ = dec.decode_attention(q, k, v, storage.stage_k[0], storage.stage_v[0],
                                                  tables, splits.layer(0),
                                                  kernel_batch(plans, DEV), scale, parts=parts)
                    errs = []
                    for p in plans:
                        rows = slice(p.q_start, p.q_start + p.q_len)
                        want = request_forward(storage, 0, p, q[rows], k[rows], v[rows], scale)
                        errs.append(f"{(out[rows].float() - want.float()).abs().max().item():.3g}")
                    return f"max error per request {errs}"

                _report(f"decode {precision} {name} {strategy.name} [{tag}]", run)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"micro": lambda: micro(), "pv": lambda: pv(), "seal": lambda: seal(args),
     "decode": lambda: decode(args)}[mode]()
