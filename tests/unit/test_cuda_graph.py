"""Decode under a captured graph (attention_backend/graph.py) against eager decode.

Twin storages in the same state after a prefill. One decodes eagerly with the torch reference;
the other captures a decode graph of the Triton path once (on a batch of padding only, as
SGLang's runner does) and then only replays it, each step after writing the planned batch into
the graph's static buffers. Over many steps requests cross page boundaries (some steps seal a
page, others do not), the batch shrinks below the graph's size (padding rows with garbage
inputs), and every step the outputs, rows, staging pages (the scratch page aside), statistics,
bookkeeping and counters must agree. On a GPU the graph is a real torch.cuda.CUDAGraph; on the
CPU it is tests/unit/graph_replay.RecordedGraph over Triton's interpreter.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from sgl_ragged.attention_backend.graph import DecodeGraphBuffers
from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.planner import plan_batch, take_staging
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from sgl_ragged.attention_backend.triton_impl import TritonAttention
from sgl_ragged.kernels.aot import layout_split_ratios
from sgl_ragged.mem_pool.storage import RaggedStorage
from tests.conftest import INTERPRET
from tests.unit.graph_replay import HostReadInCapture, RecordedGraph
from tests.unit.kernel_cases import GQA, H_KV, D, P, Spec, random_plans, random_storage

SCALE = 1 / math.sqrt(D)
WINDOW, OBS = 1, 4
# Two layers on a GPU; one under Triton's interpreter, where each replayed step's kernel launches
# are most of the unit tests' time (session 50: on a 2-core Zen 1 a replay case with two layers
# took over 10 minutes, and the six of them would have run unit-a past CI's 90). The layers of
# a graph share its buffers and plan: every one reads them as the first does.
LAYERS = 1 if INTERPRET else 2
CONTEXT_PAGES = 8
# Decode steps replayed per case: at least STEPS (every request advances at least P tokens,
# through steps below the graph's batch size), then on until a step has sealed a page (a
# wider window seals later). Session 51: a fixed 2 * P + 2 steps took 134-255 s a case in a
# clean-clone CI on a 2-core Zen 1, the six cases 19 of unit-a's 38 minutes.
STEPS, MAX_STEPS = P + 3, 4 * P


class CudaGraph:
    """torch.cuda.CUDAGraph behind RecordedGraph's interface."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    @contextmanager
    def capture(self) -> Iterator[None]:
        with torch.cuda.graph(self.graph):
            yield

    def replay(self) -> None:
        self.graph.replay()
        torch.cuda.synchronize()


def _graph() -> RecordedGraph | CudaGraph:
    return RecordedGraph() if INTERPRET else CudaGraph()


class Requests:
    """Requests with distinct random pages in a req_to_token table (row 0 = padding)."""

    def __init__(self, n: int, num_pages: int, rng: random.Random, device: str,
                 window: int = WINDOW) -> None:
        self.window = window  # --ragged-window-pages
        pages = rng.sample(range(1, num_pages), n * CONTEXT_PAGES)
        slots = torch.tensor(pages).view(n, CONTEXT_PAGES, 1) * P + torch.arange(P)
        self.req_to_token = torch.zeros(n + 1, CONTEXT_PAGES * P, dtype=torch.int32)
        self.req_to_token[1:] = slots.flatten(1)
        self.req_to_token = self.req_to_token.to(device)
        self.seq_lens = [0] * (n + 1)

    def plan(self, storage: RaggedStorage, rows: list[int], new: list[int]) -> BatchPlan:
        prefixes = [self.seq_lens[r] for r in rows]
        seq_lens = [s + n for s, n in zip(prefixes, new, strict=True)]
        plan = plan_batch(self.req_to_token, storage, rows, prefixes, seq_lens, self.window, OBS)
        return take_staging(storage, plan)

    def advance(self, rows: list[int], new: list[int]) -> None:
        for r, n in zip(rows, new, strict=True):
            self.seq_lens[r] += n


def _eager(storage: RaggedStorage, meta: BatchPlan, qkv: list, decode: bool) -> list:
    impl = TorchAttention(storage)
    batch = impl.prepare(meta)
    outs = [impl.forward(layer, batch, *qkv[layer], SCALE, decode) for layer in range(LAYERS)]
    storage.mark_sealed(meta.pages_to_seal)
    return outs


def _random_qkv(n: int, gen: torch.Generator, device: str) -> list:
    return [(torch.randn(n, H_KV * GQA, D, generator=gen).to(device),
             torch.randn(n, H_KV, D, generator=gen).to(device),
             torch.randn(n, H_KV, D, generator=gen).to(device)) for _ in range(LAYERS)]


def _assert_same(got: RaggedStorage, want: RaggedStorage) -> None:
    """Same rows (low tiers included), staging pages and statistics (the scratch page aside),
    bookkeeping, counters. Low-tier codes agree exactly (the sealing kernel codes like the torch
    quantizer; a rounding tie, which may go either way, is vanishingly rare on random data)."""
    S = want.num_staging_pages
    rows = [(a, b) for x, y in ((got.rows_k, want.rows_k), (got.rows_v, want.rows_v))
            for la, lb in zip(x, y, strict=True) for a, b in zip(la, lb, strict=True)]
    rows += [(a, b) for la, lb in zip(got.low_rows, want.low_rows, strict=True)
             for ta, tb in zip(la, lb, strict=True) if ta is not None
             for a, b in zip(ta.tensors(), tb.tensors(), strict=True)]
    staged = [(a[:S], b[:S]) for a, b in zip([*got.stage_k, *got.stage_v, *got.stats.tensors()],
                                             [*want.stage_k, *want.stage_v, *want.stats.tensors()],
                                             strict=True)]
    for i, (a, b) in enumerate(rows + staged):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"tensor {i}: {m}")
    assert torch.equal(got.page_to_stage, want.page_to_stage)
    assert torch.equal(got.sealed, want.sealed)
    assert got.counters == want.counters


@pytest.mark.parametrize("seed,window,precision", [(0, 1, "bf16"), (1, 0, "bf16"), (2, 2, "bf16"),
                                                   (8, 1, "int4"), (4, 0, "fp8"),
                                                   (9, 1, "mixed")])
def test_replayed_decode_graph_matches_eager_decode(kernel_device, seed, window, precision):
    """window: --ragged-window-pages, which sizes the graph's tail buffers (W + 1 per request);
    precision: --ragged-precision (rows with a low tier, sealed by the kernel in the graph)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_req, bs = 3, 4
    graph_store = random_storage(rng, kernel_device, layers=LAYERS, num_pages=40, num_stages=16,
                                 precision=precision)
    assert graph_store.layout.quantized == (precision != "bf16")
    requests = Requests(n_req, graph_store.num_pages, rng, kernel_device, window)
    # Prefill (eager) to random lengths: sealed pages, staged window pages, partial pages.
    rows = list(range(1, n_req + 1))
    lens = [rng.randint(P // 2, 3 * P) for _ in rows]
    prefill = requests.plan(graph_store, rows, lens)
    _eager(graph_store, prefill, _random_qkv(sum(lens), gen, kernel_device), decode=False)
    requests.advance(rows, lens)
    eager_store = copy.deepcopy(graph_store)

    # Capture once, on a batch of padding only (after one eager warm-up, as SGLang does).
    impl = TritonAttention(graph_store, layout_split_ratios(graph_store.layout))
    buffers = DecodeGraphBuffers(graph_store, max_bs=bs, window_pages=window,
                                 max_pages_per_request=CONTEXT_PAGES)
    static = _random_qkv(bs, gen, kernel_device)
    capture_meta = buffers.capture_metadata(bs)

    def forward() -> list[torch.Tensor]:
        return [impl.forward(layer, capture_meta, *static[layer], SCALE, True)
                for layer in range(LAYERS)]

    forward()
    graph = _graph()
    with graph.capture():
        outs = forward()
    assert graph_store.counters == eager_store.counters  # padding counted nothing

    sealing_steps = 0
    for step in range(MAX_STEPS):
        active = rows if step % 5 != 3 else rows[1:]  # some steps run below the graph's size
        ones = [1] * len(active)
        replay_plan = requests.plan(graph_store, active, ones)
        buffers.load(bs, replay_plan)
        eager_meta = requests.plan(eager_store, active, ones)
        sealing_steps += eager_meta.pages_to_seal.numel() > 0
        qkv = _random_qkv(bs, gen, kernel_device)  # rows past the batch: garbage padding
        for layer in range(LAYERS):
            for buf, x in zip(static[layer], qkv[layer], strict=True):
                buf.copy_(x)
        graph.replay()
        graph_store.mark_sealed(replay_plan.pages_to_seal)  # finish_graph_replay's work
        want = _eager(eager_store, eager_meta, [tuple(x[: len(active)] for x in t) for t in qkv],
                      decode=True)
        requests.advance(active, ones)
        for layer in range(LAYERS):
            torch.testing.assert_close(outs[layer][: len(active)], want[layer], atol=1e-4,
                                       rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
        _assert_same(graph_store, eager_store)
        if step + 1 >= STEPS and sealing_steps:
            break
    assert 0 < sealing_steps < step + 1  # steps with and without sealing were replayed


@pytest.mark.parametrize("precision", ["bf16", "int2"])
def test_capture_of_padding_writes_only_the_scratch_page(kernel_device, precision):
    """A batch of padding only (capture, warm-up, idle replays) changes nothing else."""
    storage = random_storage(random.Random(5), kernel_device, layers=LAYERS, precision=precision)
    before = copy.deepcopy(storage)
    impl = TritonAttention(storage, layout_split_ratios(storage.layout))
    meta = DecodeGraphBuffers(storage, 3, WINDOW, CONTEXT_PAGES).capture_metadata(3)
    for layer, (q, k, v) in enumerate(_random_qkv(3, torch.Generator().manual_seed(1),
                                                  kernel_device)):
        impl.forward(layer, meta, q, k, v, SCALE, True)
    _assert_same(storage, before)


def test_load_rejects_batches_over_the_graph_capacity():
    storage = random_storage(random.Random(2), "cpu", layers=1)
    buffers = DecodeGraphBuffers(storage, 2, WINDOW, CONTEXT_PAGES)
    rng = random.Random(3)

    def meta(specs: list[Spec]) -> BatchPlan:
        return BatchPlan(requests=random_plans(storage, specs, rng))

    buffers.load(2, meta([Spec(sealed=2, staged=P, q_len=1, seal=1), Spec(1, 3, 1)]))
    with pytest.raises(RuntimeError, match="tail pages 3 > 2"):  # 2P + 1 tail tokens
        buffers.load(1, meta([Spec(sealed=1, staged=2 * P, q_len=1, seal=2)]))
    with pytest.raises(RuntimeError, match="more than one new token"):
        buffers.load(2, meta([Spec(sealed=0, staged=0, q_len=2)]))
    with pytest.raises(RuntimeError, match="sealed pages of one request 9 > 8"):
        buffers.load(2, meta([Spec(sealed=9, staged=0, q_len=1)]))
    with pytest.raises(ValueError, match="outside"):
        buffers.views(3)


# ---- the stand-in itself: it must catch what a CUDA graph would get wrong ---------------------


def test_recorded_graph_replays_capture_time_host_decisions():
    x, n = torch.zeros(3), torch.tensor([1.0])
    factor = [2.0]
    graph = RecordedGraph()
    with graph.capture():
        y = x + n * 2  # device data: follows the buffers
        z = x * factor[0] + 1  # a host value: frozen at capture
    x.fill_(1.0)
    n.fill_(5.0)
    factor[0] = 10.0
    graph.replay()
    assert y.tolist() == [11.0] * 3  # the capture's outputs hold the replay's results
    assert z.tolist() == [3.0] * 3  # 1 * 2 + 1, not 1 * 10 + 1


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: t.tolist(), lambda t: bool(t[0]),
                                  lambda t: torch.tensor([1, 2]), lambda t: t.nonzero(),
                                  lambda t: t[t > 0]])
def test_recorded_graph_rejects_host_reads(read):
    t = torch.ones(2)
    graph = RecordedGraph()
    with pytest.raises(HostReadInCapture), graph.capture():
        read(t)


def test_recorded_graph_replays_triton_launches(kernel_device):
    if not INTERPRET:
        pytest.skip("the stand-in records Triton launches under the interpreter only")
    storage = random_storage(random.Random(7), "cpu", layers=1)
    impl = TritonAttention(storage, layout_split_ratios(storage.layout))
    plans = random_plans(storage, [Spec(sealed=2, staged=3, q_len=1)], random.Random(8))
    batch = impl.prepare(BatchPlan(requests=plans))
    q, k, v = _random_qkv(1, torch.Generator().manual_seed(9), "cpu")[0]
    graph = RecordedGraph()
    with graph.capture():
        out, _ = impl.attend(0, batch.kernel, q, k, v, SCALE, True)
    first = out.clone()
    q.mul_(-1.0)
    graph.replay()
    want, _ = impl.attend(0, batch.kernel, q, k, v, SCALE, True)
    assert not torch.allclose(first, want)
    torch.testing.assert_close(out, want)


# ---- the backend's graph hooks (what SGLang's decode graph runner calls) ---------------------


def _backend(storage: RaggedStorage, impl, requests: Requests):
    """SGLang's RaggedAttnBackend over a core built from plain arguments (no ModelRunner)."""
    from sgl_ragged.attention_backend.backend import RaggedAttention
    from sgl_ragged.config import RaggedConfig
    from sgl_ragged.serving.backend import RaggedAttnBackend

    config = RaggedConfig(profile="uniform:0.3", window_pages=WINDOW, obs_window=OBS)
    return RaggedAttnBackend(RaggedAttention(storage, impl, config, requests.req_to_token))


def test_backend_graph_hooks_plan_only_the_real_requests():
    from types import SimpleNamespace

    pytest.importorskip("sglang")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_ragged.serving.scheduler_hooks import after_decode_graph_replay

    rng = random.Random(4)
    storage = random_storage(rng, "cpu", layers=1, num_pages=40)
    requests = Requests(3, storage.num_pages, rng, "cpu")
    with pytest.raises(RuntimeError, match="cannot run under CUDA graphs"):
        _backend(storage, TorchAttention(storage), requests).init_cuda_graph_state(4, 4)
    impl = TritonAttention(storage, layout_split_ratios(storage.layout))
    backend = _backend(storage, impl, requests)
    backend.init_cuda_graph_state(4, 4)
    assert backend.attention.graph_buffers.max_pages_per_request == CONTEXT_PAGES
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    # Capture: padding only, no planning.
    backend.init_forward_metadata_out_graph(SimpleNamespace(batch_size=4, forward_mode=ForwardMode.DECODE),
                                            in_capture=True)
    assert backend.forward_metadata.graph and backend.forward_metadata.plan.requests == []
    # Replay of 2 real requests padded to 4: rows 3 and 2 are about to complete a page.
    requests.seq_lens[3], requests.seq_lens[2] = 2 * P - 1, P - 3
    for r in (3, 2):
        storage.stage(int(requests.req_to_token[r, 0]) // P)  # prefilled pages, staged
        storage.stage(int(requests.req_to_token[r, P]) // P)
    backend.init_forward_metadata_out_graph(_replay_view([3, 2], [2 * P, P - 2], 4))
    meta = backend.forward_metadata
    assert meta.graph and [p.seq_len for p in meta.plan.requests] == [2 * P, P - 2]
    first_page = int(requests.req_to_token[3, 0]) // P
    assert meta.plan.pages_to_seal.tolist() == [first_page]  # request 3 completed its 2nd page
    runner = SimpleNamespace(_replay_attn_backend=lambda: backend)
    after_decode_graph_replay(None, runner)  # the plugin's hook after the runner's execute
    assert storage.sealed[first_page] and storage.page_to_stage[first_page] < 0
    # An idle replay (no requests): padding only again.
    backend.init_forward_metadata_out_graph(_replay_view([], [], 4, ForwardMode.IDLE))
    assert backend.forward_metadata.plan.requests == []


def _replay_view(pool_idx: list[int], seq_lens: list[int], bs: int, mode=None):
    """The batch SGLang's decode graph runner hands the backend before a replay
    (build_replay_fb_view over its padded input buffers: pool index 0, seq_len 1 past the
    real requests)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

    pad = bs - len(pool_idx)
    lens = torch.tensor(seq_lens + [1] * pad)
    buffers = SimpleNamespace(input_ids=torch.zeros(bs, dtype=torch.long), positions=lens - 1,
                              req_pool_indices=torch.tensor(pool_idx + [0] * pad), seq_lens=lens,
                              seq_lens_cpu=lens.clone(), encoder_lens=None,
                              mamba_track_indices=None)
    batch = SimpleNamespace(forward_mode=mode or ForwardMode.DECODE, seq_lens_sum=sum(seq_lens),
                            seq_lens_cpu=torch.tensor(seq_lens), max_seq_len_host=None,
                            out_cache_loc=None, out_cache_loc_virtual=None, kv_loc_plan=None,
                            kv_loc_cols=None, max_seq_len_override=None, spec_info=None,
                            lora_ids=None, can_run_decode_cuda_graph=True)
    return build_replay_fb_view(
        forward_batch=batch, buffers=buffers, bs=bs, raw_bs=len(pool_idx), num_tokens=bs,
        global_num_tokens_cpu=None, seq_len_fill_value=1,
        capture_forward_mode=ForwardMode.DECODE, is_encoder_decoder=False)


@pytest.mark.parametrize("attention,profile,device,decode,precision,head_dim", [
    ("auto", "uniform:0.3", "cuda", "full", "bf16", 64),
    ("triton", "uniform:0.3", None, "full", "bf16", 64),
    ("auto", "uniform:0.3", "cpu", "disabled", "bf16", 64),
    ("reference", "uniform:0.3", "cuda", "disabled", "bf16", 64),
    ("batched", "uniform:0.3", "cuda", "disabled", "bf16", 64),
    ("auto", "dynamic:0.3", "cuda", "disabled", "bf16", 64),
    ("auto", " Dynamic:0.3", "cuda", "disabled", "bf16", 64),  # any case, as the resolver reads it
    ("auto", "uniform:0.3", "cuda", "full", "int4", 64),  # the kernels read low tiers
    ("triton", "uniform:0.3", "cuda", "full", "fp8", 128),
    ("auto", "uniform:0.3", "cuda", "disabled", "int4", 96),  # auto: batched (triton_refuses)
    ("auto", "uniform:0.3", "cuda", "full", "bf16", 96),
])
def test_server_args_keep_decode_graphs_only_for_the_triton_path(attention, profile, device,
                                                                 decode, precision, head_dim):
    from types import SimpleNamespace

    pytest.importorskip("sglang")
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig

    from sgl_ragged.config import RaggedConfig
    from sgl_ragged.serving.server_args import _decode_graphs, _graph_config

    config = RaggedConfig.from_env({"RAGGED_PROFILE": profile, "RAGGED_ATTENTION": attention,
                                    "RAGGED_PRECISION": precision})
    cfg = SimpleNamespace(cuda_graph_config=CudaGraphConfig(), device=device)
    resolved = _graph_config(cfg.cuda_graph_config, _decode_graphs(cfg, config, head_dim))
    assert (resolved.decode.backend, resolved.prefill.backend) == (decode, "disabled")


def test_server_args_reject_graph_setups_the_backend_cannot_run(monkeypatch):
    from types import SimpleNamespace

    pytest.importorskip("sglang")
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, Phase, with_phase

    from sgl_ragged.config import RaggedConfig
    from sgl_ragged.serving.server_args import _decode_graphs

    config = RaggedConfig.from_env({"RAGGED_PROFILE": "uniform:0.3"})
    breakable = with_phase(CudaGraphConfig(), Phase.DECODE, backend="breakable")
    with pytest.raises(ValueError, match="breakable is not supported"):
        _decode_graphs(SimpleNamespace(cuda_graph_config=breakable, device="cuda"), config)
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")
    with pytest.raises(ValueError, match="METADATA_GLUE_GRAPH"):
        _decode_graphs(SimpleNamespace(cuda_graph_config=CudaGraphConfig(), device="cuda"), config)


def test_server_args_reject_torch_compile():
    from types import SimpleNamespace

    pytest.importorskip("sglang")
    from sgl_ragged.serving.server_args import _check_unsupported

    cfg = SimpleNamespace(speculative_algorithm=None, tp_size=1, page_size=64,
                          enable_torch_compile=True)
    with pytest.raises(ValueError, match="--enable-torch-compile is not supported"):
        _check_unsupported(cfg)
    _check_unsupported(SimpleNamespace(**{**vars(cfg), "enable_torch_compile": False}))

