"""Decode under CUDA graphs: the kernels' per-forward inputs in static, fixed-capacity buffers.

A captured graph replays the kernel launches of one forward with the addresses, grid sizes and
scalars of its capture. So what the Triton path builds per forward (its `TritonBatch`:
`KernelBatch` and `TailBatch`) lives here in buffers sized for the graph's batch size bs, and every replay writes the real
batch into them before the graph runs (`load`, on the host, outside the graph). Everything past
the real batch is padding that does nothing harmful:

    | buffer                 | capacity          | padding entry                                 |
    |------------------------|-------------------|-----------------------------------------------|
    | KernelBatch rows       | bs requests       | q_start = own row, no sealed or staged tokens |
    | TailBatch pages        | bs * (W + 1)      | no staged, no fresh tokens, no window queries |
    | seal entries           | bs                | page -1: the sealing kernel writes nothing    |
    | stay entries           | bs * (W + 1)      | staging page = the scratch page               |

The capacities hold because a decoding request's tail is at most W + 1 pages (W = the window:
after each forward at most W complete pages and a partial one stay staged) and one new token
completes at most one page, so a decode step seals at most one page per request. `load`
checks them anyway. The padding requests of SGLang's padded batch (rows past the real ones)
are never planned: planning them would stage pages of req_to_token row 0.

What the eager path does on the host inside the forward moves out of the graph: the seal
counters are counted in `load` (the buffers' TailBatch is not `counted`, so
`RaggedStorage.seal` counts nothing inside the graph), and the post-forward bookkeeping (`mark_sealed`) runs after the
replay (RaggedAttnBackend.finish_graph_replay).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from sgl_ragged.attention_backend.plan import BatchPlan
from sgl_ragged.attention_backend.tail_batch import TailBatch
from sgl_ragged.attention_backend.triton_batch import TritonBatch, triton_batch
from sgl_ragged.kernels.batch import KernelBatch
from sgl_ragged.mem_pool.storage import RaggedStorage

_TAIL_PER_PAGE = ("page_req", "page_start", "prior_stage", "has_prior", "staged", "fresh",
                  "new_row", "source_row", "obs", "page_win_row", "page_sees", "page_saw", "page_win_pos",
                  "n_staged", "held_stage")
"""TailBatch fields indexed by tail page m (capacity bs * (W + 1))."""

_PADDING = {"q_len": 1, "seal_pages": -1, "page_win_pos": -1, "held_stage": -1}
"""Padding values other than 0 / False (q_start and stay_stage are set per graph)."""


class DecodeGraphBuffers:
    """A static TritonBatch (KernelBatch and TailBatch) for decode graphs of up to max_bs
    requests.

    The graph of batch size bs reads `views(bs)`: leading slices of the same buffers, so a
    graph's addresses stay fixed across replays and the graphs of different sizes share memory
    (one replay at a time).
    """

    def __init__(self, storage: RaggedStorage, max_bs: int, window_pages: int,
                 max_pages_per_request: int) -> None:
        self.storage = storage
        self.max_bs = max_bs
        self.pages_per_request = window_pages + 1  # tail pages of a decoding request
        self.max_pages_per_request = max_pages_per_request
        dev, P = storage.device, storage.layout.page_size
        M = max_bs * self.pages_per_request

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        i32, b, f32 = torch.int32, torch.bool, torch.float32
        self.kernel = KernelBatch(
            q_start=zeros(max_bs, dtype=i32), q_len=zeros(max_bs, dtype=i32),
            num_sealed=zeros(max_bs, dtype=i32),
            sealed_table=zeros(max_bs, max_pages_per_request, dtype=i32),
            num_staged=zeros(max_bs, dtype=i32),
            stage_table=zeros(max_bs, self.pages_per_request, dtype=i32),
            max_q_len=1, max_sealed=max_pages_per_request,
        )
        self.tails = TailBatch(
            page_req=zeros(M), page_start=zeros(M), prior_stage=zeros(M),
            has_prior=zeros(M, dtype=b), staged=zeros(M, P, dtype=b), fresh=zeros(M, P, dtype=b),
            new_row=zeros(M, P), source_row=zeros(M, P), obs=zeros(M, P, dtype=f32), page_win_row=zeros(M, 1),
            page_sees=zeros(M, 1, P, dtype=b), page_saw=zeros(M, 1, dtype=f32),
            page_win_pos=zeros(M, 1), n_staged=zeros(M), held_stage=zeros(M),
            seal_index=zeros(max_bs), seal_pages=zeros(max_bs), stay_index=zeros(M),
            stay_stage=zeros(M), num_seal=max_bs, num_stay=M, counted=False,
        )
        self._views: dict[int, TritonBatch] = {}

    def views(self, bs: int) -> TritonBatch:
        """The buffers of the graph of batch size bs (the same tensor objects every call)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"decode graph batch size {bs} is outside [1, {self.max_bs}]")
        if bs not in self._views:
            m = bs * self.pages_per_request
            k, t = self.kernel, self.tails
            kernel = replace(k, **{f.name: getattr(k, f.name)[:bs] for f in fields(k)
                                   if isinstance(getattr(k, f.name), torch.Tensor)})
            tails = replace(t, **{name: getattr(t, name)[:m] for name in _TAIL_PER_PAGE},
                            seal_index=t.seal_index[:bs], seal_pages=t.seal_pages[:bs],
                            stay_index=t.stay_index[:m], stay_stage=t.stay_stage[:m],
                            num_seal=bs, num_stay=m)
            self._views[bs] = TritonBatch(kernel=kernel, tails=tails)
        return self._views[bs]

    def capture_metadata(self, bs: int) -> TritonBatch:
        """The prepared batch of a graph capture (and its warm-up runs): padding only."""
        batch = self.views(bs)
        self._pad(batch.kernel, batch.tails)
        return batch

    def load(self, bs: int, plan: BatchPlan) -> TritonBatch:
        """Write the planned decode batch (at most bs requests, one token each, staging taken)
        into the graph's buffers, padding the rest; count its sealed pages. Returns the
        replay's prepared batch (the buffers)."""
        plans = plan.requests
        if len(plans) > bs or any(p.q_len != 1 for p in plans):
            raise RuntimeError(f"a decode graph of batch size {bs} cannot run {len(plans)} "
                               "requests or a request with more than one new token")
        assert plan.staged, "planner.take_staging did not run for this plan"
        batch = self.views(bs)
        kernel, tails = batch.kernel, batch.tails
        live = triton_batch(plan, self.storage.layout.page_size, self.storage.device)
        live_kernel, live_tails = live.kernel, live.tails
        self._check_capacity(bs, live_kernel, live_tails)
        self._pad(kernel, tails)
        for name in ("q_start", "q_len", "num_sealed", "sealed_table", "num_staged", "stage_table"):
            _copy_leading(getattr(kernel, name), getattr(live_kernel, name))
        for name in (*_TAIL_PER_PAGE, "seal_index", "seal_pages", "stay_index", "stay_stage"):
            _copy_leading(getattr(tails, name), getattr(live_tails, name))
        for layer in range(self.storage.layout.num_layers):
            self.storage.count_sealed(layer, live_tails.num_seal)
        return batch

    def _check_capacity(self, bs: int, kernel: KernelBatch, tails: TailBatch) -> None:
        limits = {
            "tail pages": (tails.page_req.numel(), bs * self.pages_per_request),
            "sealed pages": (tails.num_seal, bs),
            "sealed pages of one request": (kernel.sealed_table.shape[1], self.max_pages_per_request),
            "staged pages of one request": (kernel.stage_table.shape[1], self.pages_per_request),
            "window queries": (tails.page_win_row.shape[1], 1),
        }
        over = [f"{what} {n} > {cap}" for what, (n, cap) in limits.items() if n > cap]
        if over:
            raise RuntimeError(
                f"a decode batch exceeds its graph's static buffers ({'; '.join(over)}); this "
                "breaks the ragged backend's invariants (a decoding request keeps at most "
                "--ragged-window-pages + 1 tail pages). Work around it with "
                "--cuda-graph-backend-decode disabled and report it."
            )

    def _pad(self, kernel: KernelBatch, tails: TailBatch) -> None:
        """Padding values everywhere; request b's own row as its q_start."""
        for t in (kernel, tails):
            for f in fields(t):
                value = getattr(t, f.name)
                if isinstance(value, torch.Tensor):
                    value.fill_(_PADDING.get(f.name, 0))
        torch.arange(kernel.q_start.numel(), out=kernel.q_start)
        tails.stay_stage.fill_(self.storage.scratch_stage)


def _copy_leading(static: torch.Tensor, live: torch.Tensor) -> None:
    """static[:n, :w, ...] = live (live's shape fits inside static's)."""
    if live.numel():
        static[tuple(slice(0, n) for n in live.shape)].copy_(live)
