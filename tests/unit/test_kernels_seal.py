"""The sealing kernel against `Sealer.write` (select_top_k + gather) as oracle.

Random scores with deliberate ties (the stable tie-break must match), sink pages, k == P groups,
pages gathered from a larger source; rows of pages that are not sealed must stay untouched.
With a low tier the kernel's quantized codes and parameters must match `quant.quantize`'s
(codes may differ on rounding ties only).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from sgl_ragged.kernels.seal import seal_pages
from sgl_ragged.kernels.tables import format_parts, layer_tables
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.profile import uniform_profile
from sgl_ragged.scoring.select import sink_mask
from tests.unit.kernel_cases import H_KV, P, make_storage, random_storage, storage_state

LOW = ["int8", "int4", "int2", "fp8"]
PAIRS = ["int8+int4", "fp8+int2"]  # a quantized high tier too


def _scores(n: int, gen: torch.Generator, ties: bool) -> torch.Tensor:
    """[n, H, P] float32; with ties, values from a set of 3 so most tokens tie."""
    if ties:
        return torch.randint(0, 3, (n, H_KV, P), generator=gen).float()
    return torch.rand(n, H_KV, P, generator=gen)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seal_matches_write_rows(kernel_device, ties, dtype):
    _check_seal(kernel_device, ties, dtype, "bf16", int(ties) * 2 + (dtype == torch.float32))


@pytest.mark.parametrize("precision", LOW)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seal_quantizes_like_write_rows(kernel_device, precision, dtype):
    """Low tiers: hi rows copied, lo tokens quantized and packed in the kernel (seed 10: every
    group of the sealed layer has a low tier; with bfloat16 rows some have no full-precision
    slot at all)."""
    _check_seal(kernel_device, False, dtype, precision, 10)


@pytest.mark.parametrize("precision", PAIRS)
def test_seal_quantizes_both_tiers_like_write_rows(kernel_device, precision):
    """A quantized high tier (--ragged-precision H+L): both tiers quantized and packed in the
    kernel (seed 10, bfloat16: the sealed layer has groups with both tiers, and groups with
    only one of them)."""
    _check_seal(kernel_device, False, torch.bfloat16, precision, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seal_mixed_formats_one_launch_per_format(kernel_device, dtype):
    """A low format per group (--ragged-precision mixed): one launch per format over its
    groups' heads (tables.format_parts), each quantizing into its groups' own format."""
    _check_seal(kernel_device, False, dtype, "mixed", 12)


def _check_seal(kernel_device, ties, dtype, precision, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(5 + seed)
    kernel_store = random_storage(rng, kernel_device, layers=2, heads_per_group=rng.choice([1, 2]),
                                  dtype=dtype, precision=precision)
    tiers = kernel_store.layout.tiers[1]
    if "+" in precision:
        assert any(t.hi and t.lo for t in tiers) and any(not (t.hi and t.lo) for t in tiers)
        assert all(x.shape[1] == 0 for x in kernel_store.rows_k[1])
    elif precision == "mixed":
        assert len({kernel_store.layout.low_format(1, g) for g in range(len(tiers))}) > 1
    else:
        assert all(t.lo for t in tiers) == (precision != "bf16")
    oracle = copy.deepcopy(kernel_store)  # same groups, rows and low tiers
    layer, n = 1, 5
    # The source in the storage dtype, as in serving (the interpreter's float32 -> bfloat16
    # store truncates where torch rounds, so a cast would not be bit-exact on the CPU).
    src_k = torch.randn(n + 3, P, H_KV, 16, generator=gen).to(kernel_device, dtype)
    src_v = torch.randn(n + 3, P, H_KV, 16, generator=gen).to(kernel_device, dtype)
    src_index = torch.tensor(rng.sample(range(n + 3), n), device=kernel_device)
    pages = torch.tensor(rng.sample(range(1, 40), n), device=kernel_device)
    start = torch.tensor([0, P, 0, 3 * P, 7 * P], device=kernel_device)  # two first pages: sinks
    scores = _scores(n, gen, ties).to(kernel_device)
    tables = layer_tables(kernel_store, layer)
    seal_pages(tables, src_k, src_v, src_index.int(), pages.int(), scores, sink_mask(start, P),
               format_parts(tables, kernel_store.layout, layer))
    oracle.write_sealed(layer, pages, src_k[src_index], src_v[src_index],
                        oracle.sealer.choose(scores, start))
    # Every row and low-tier tensor of both layers (the other layer must stay untouched).
    for i, (got, want) in enumerate(zip(storage_state(kernel_store), storage_state(oracle),
                                        strict=True)):
        if got.dtype == torch.uint8:  # codes: rounding ties may go either way
            assert (got != want).float().mean() <= 0.01, f"tensor {i}: codes differ"
            assert (got[pages] != want[pages]).float().mean() <= 0.01, f"tensor {i}: codes differ"
        else:
            assert torch.equal(got, want), f"tensor {i} ({tuple(got.shape)})"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU shapes need CUDA")
@pytest.mark.parametrize("precision", ["bf16", *LOW, *PAIRS, "mixed"])
def test_seal_gpu_shapes(precision):
    """P 64, D 128, 8 KV heads, bfloat16, many pages in one launch."""
    from tests.unit.kernel_cases import GPU

    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    storage = random_storage(rng, "cuda", num_pages=256, dtype=torch.bfloat16, shape=GPU,
                             precision=precision)
    assert storage.layout.quantized == (precision != "bf16")
    oracle = copy.deepcopy(storage)
    n, p, h, d = 100, GPU.page_size, GPU.kv_heads, GPU.head_dim
    src_k = torch.randn(n, p, h, d, generator=gen).to("cuda", torch.bfloat16)
    src_v = torch.randn(n, p, h, d, generator=gen).to("cuda", torch.bfloat16)
    pages = torch.tensor(rng.sample(range(1, 256), n), device="cuda")
    start = p * torch.arange(n, device="cuda")
    scores = torch.rand(n, h, p, generator=gen).to("cuda")
    tables = layer_tables(storage, 0)
    seal_pages(tables, src_k, src_v, torch.arange(n, device="cuda").int(), pages.int(), scores,
               sink_mask(start, p), format_parts(tables, storage.layout, 0))
    oracle.write_sealed(0, pages, src_k, src_v, oracle.sealer.choose(scores, start))
    for i, (got, want) in enumerate(zip(storage_state(storage), storage_state(oracle),
                                        strict=True)):
        if got.dtype == torch.uint8:  # codes: rounding ties may go either way
            assert (got != want).float().mean() <= 0.01, f"tensor {i}: codes differ"
        else:
            assert torch.equal(got, want), f"tensor {i} ({tuple(got.shape)})"


# ---- finish-time sealing under SGLang's overlap scheduler ----------------------------------


def _page_to_seal(device: str) -> tuple[RaggedStorage, RaggedStorage]:
    """A storage whose logical page 4 is staged with random K/V and observation counts, and
    its twin with that page already sealed by seal_staged on an idle device."""
    storage = make_storage(uniform_profile(0.5, 2, 2, 1), 8, 4, 12, 4, device=device)
    gen = torch.Generator().manual_seed(5)
    s = storage.stage(4)
    H, D = storage.layout.num_kv_heads, storage.layout.head_dim
    k, v = (torch.randn(1, 8, H, D, generator=gen).to(device) for _ in range(2))
    storage.stage_kv(0, torch.tensor([s], device=device), k, v)
    storage.write_obs(s, torch.arange(1.0, 9))
    twin = copy.deepcopy(storage)
    twin.seal_staged(torch.tensor([4]), torch.tensor([0]))
    return storage, twin


def _assert_sealed_as(storage: RaggedStorage, twin: RaggedStorage) -> None:
    for a, b in zip(storage.rows_k[0] + storage.rows_v[0], twin.rows_k[0] + twin.rows_v[0],
                    strict=True):
        assert torch.equal(a[4], b[4]) and a[4].abs().sum() > 0
    assert storage.sealed[4] and storage.staging_in_use == 0


def test_finish_time_sealing_follows_no_stream_on_a_cpu():
    """On a CPU every op has finished when it returns: follow_forward records nothing and
    seal_staged writes what it writes without it."""
    storage, twin = _page_to_seal("cpu")
    storage.follow_forward()
    assert storage._forward_stream is None
    storage.seal_staged(torch.tensor([4]), torch.tensor([0]))
    _assert_sealed_as(storage, twin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the forwards' "
                    "stream is a CUDA stream; scripts/gpu_check.sh runs this)")
def test_finish_time_sealing_runs_behind_the_forward_in_flight():
    """SGLang's overlap scheduler seals a finished request's pages (seal_staged, from its result
    processing on the scheduler's stream) while the next forward still runs on the forward
    stream: the seal must queue behind that forward. Here the forward is a long sleep on a side
    stream; the seal, called from the default stream, must leave the default stream idle and
    write the rows a seal on an idle device writes once the side stream gets to it."""
    storage, twin = _page_to_seal("cuda")
    torch.cuda.synchronize()
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        storage.follow_forward()  # as begin_forward does, on the forward's stream
        torch.cuda._sleep(200_000_000)  # the forward in flight (about 0.1 s)
    storage.seal_staged(torch.tensor([4]), torch.tensor([0]))  # from the default stream
    assert torch.cuda.current_stream().query(), "the seal ran on the scheduler's stream"
    waited = forward.query()
    forward.synchronize()
    _assert_sealed_as(storage, twin)
    assert not waited, ("seal_staged waited on the host for the forward in flight (a host sync "
                        "in the seal path): its rows are right, but it stalls the overlap")
