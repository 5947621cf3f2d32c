"""Ragged KV storage: compressed rows per (layer, head group) plus the staging pool.

Index spaces (docs/architecture.md, "The idea in one table" and "One forward pass"):

    | name          | range                 | what it indexes                                  |
    |---------------|-----------------------|--------------------------------------------------|
    | logical slot  | [0, (pages+1) * P)    | SGLang's token slots (req_to_token, radix tree)   |
    | logical page  | [0, pages+1)          | slot // P; row p of every group's tensor          |
    | row slot      | [0, k[l][g])          | composite slot j: each member head's j-th kept    |
    |               |                       | (slots [0, hi) at the model dtype, [hi, k) in the |
    |               |                       | low tier, quantized: quant.py, tiers.py; with a   |
    |               |                       | quantized high tier, [0, hi) in high_rows too)    |
    | staging page  | [0, S)                | a full page [P, H_kv, D] of a running request     |
    |               | S                     | the scratch page (CUDA-graph padding writes)      |

Page 0 is SGLang's padding page; it is never handed out.

The storage owns its writes: every path (the torch reference, the batched and native CPU
paths, the Triton kernels, finish-time sealing) changes its tensors only through the write
API below -- `stage_kv`, `stage_tokens`, `store_stats`, `write_obs`, `write_obs_pages` (staging), `seal` / `write_sealed` (rows,
through the row writer: the storage's own -- on the CPU the native kernels' `seal_rows` where
they are built (cuda_ext/seal.cpp, one call a layer), else torch ops -- or the sealing kernel
once the Triton path installs it with `use_row_writer`), `mark_sealed`, `seal_staged`. The tensor fields (rows_k, rows_v, low_rows,
high_rows, row_keep, stage_k, stage_v, stats, and the CPU bookkeeping page_to_stage,
stage_owner, sealed) are read-only outside this module: readers (attention, planning, the
kernels' address tables) read them directly.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import (
    QuantTier,
    dequantize,
    empty_tier,
    native_fields,
    native_kernels,
    quantize,
)
from sgl_ragged.mem_pool.sealer import (
    DynamicRows,
    SealBatch,
    Sealer,
    Selection,
    TierRows,
    tier_tokens,
)
from sgl_ragged.mem_pool.staging_stats import StagedQueryStats, StagingStats, page_stats
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.precision import LowPrecision
from sgl_ragged.scoring import Scorer
from sgl_ragged.transfer import to_device


class StagingExhaustedError(RuntimeError):
    """More running requests hold window pages than the staging pool was sized for."""


@dataclass
class SealCounters:
    """Totals since start, exported as metrics."""

    pages_sealed: int = 0
    tokens_sealed: int = 0  # logical tokens in sealed pages
    entries_kept: int = 0  # (token, KV head) entries kept, summed over layers
    entries_seen: int = 0  # (token, KV head) entries offered, summed over layers


class RowWriter(Protocol):
    """Writes the sealed rows of N pages of one layer as a `Selection` says: the storage's own
    writes (`RaggedStorage.write_sealed`'s default: native or torch) or the Triton sealing kernel
    (triton_impl.KernelRowWriter), installed with `RaggedStorage.use_row_writer`.

    pages: [N] int64 logical pages (-1: padding, writes nothing; only the kernel writer sees
    it, inside captured decode graphs); k_tok, v_tok: [N, P, H, D] the pages' full K/V."""

    def __call__(self, layer: int, pages: torch.Tensor, k_tok: torch.Tensor,
                 v_tok: torch.Tensor, selection: Selection) -> None: ...


RowCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""copy_rows(dst, slots, src, rows): dst[slots[i]] = src[rows[i]] in place, zeros where
rows[i] < 0 (dst [R, ...], slots and rows [N] int64, src [n, ...]); `RaggedStorage.stage_tokens`
hands it its own staging tensor."""


class PageTiers(NamedTuple):
    """Rows of N pages of one group, as stored (`RaggedStorage.page_tiers`)."""

    hi_k: torch.Tensor  # [N, hi, H_p, D] storage dtype
    hi_v: torch.Tensor  # [N, hi, H_p, D]
    low: QuantTier | None  # the N pages' low tiers (quant.py's shapes with pages = N)
    high: QuantTier | None = None  # their quantized high tiers (--ragged-precision H+L; hi_k,
    # hi_v then have no slot)


class RaggedStorage:
    """Owns every tensor of the ragged cache and the staging bookkeeping, and every write to
    them (module docstring); its `sealer` decides what the rows of pages leaving the window
    keep (sealer.py), the storage writes them."""

    def __init__(
        self,
        layout: RaggedLayout,
        num_pages: int,
        num_staging_pages: int,
        dtype: torch.dtype,
        device: str | torch.device,
        scorer: Scorer,
        dynamic_rho: float | None = None,
        scale: float | None = None,
    ) -> None:
        """scale: the model's attention softmax scale (from its config, at pool creation;
        default 1/sqrt(head_dim)), which scorers that model attention logits read."""
        self.layout = layout
        self.num_pages = num_pages  # logical pages incl. the padding page 0
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = layout.head_dim**-0.5 if scale is None else scale
        P, H, D = layout.page_size, layout.num_kv_heads, layout.head_dim
        # rows_k[l][g]: [num_pages, hi[l][g], H_p, D] the full-precision slots (all k[l][g] of
        # them without a low tier; none with a quantized high tier), indexed by logical page.
        full = [[0 if layout.high else t.hi for t in ts] for ts in layout.tiers]
        self.rows_k = [[self._zeros(num_pages, n, len(heads), D) for heads, n in zip(gs, ns, strict=True)]
                       for gs, ns in zip(layout.groups, full, strict=True)]
        self.rows_v = [[self._zeros(num_pages, n, len(heads), D) for heads, n in zip(gs, ns, strict=True)]
                       for gs, ns in zip(layout.groups, full, strict=True)]
        # low_rows[l][g]: the lo[l][g] quantized slots of every logical page (None if lo is 0).
        # (each group's in its own format, layout.low_format, with --ragged-precision mixed)
        self.low_rows = self._tiers(layout.low_format, num_pages, lambda t: t.lo)
        # high_rows[l][g]: the hi[l][g] slots quantized in layout.high (--ragged-precision H+L;
        # None without a quantized high tier or if hi is 0).
        self.high_rows = self._tiers(lambda layer, group: layout.high, num_pages, lambda t: t.hi)
        # head_index[l][g]: [H_p] int64 KV-head indices of group g.
        self.head_index = [[torch.tensor(h, dtype=torch.long, device=self.device) for h in gs]
                           for gs in layout.groups]
        # head_span[l][g]: the same heads as a slice where they are adjacent (indexing with it
        # makes a view, with a tensor a copy: about 18 us an op on a CPU, 6 per group per seal;
        # the row writers index with it).
        self.head_span = [[_span(h, index) for h, index in zip(gs, indices, strict=True)]
                          for gs, indices in zip(layout.groups, self.head_index, strict=True)]
        # stage_k[l]: [S + 1, P, H, D], indexed by staging page. Page S is the scratch page:
        # never handed out, it takes the writes of CUDA-graph padding (attention_backend/graph.py).
        rows = num_staging_pages + 1  # S + 1
        self.stage_k = [self._zeros(rows, P, H, D) for _ in range(layout.num_layers)]
        self.stage_v = [self._zeros(rows, P, H, D) for _ in range(layout.num_layers)]
        # stats: what each staging page's tokens observed (the scorers' accumulators), [S + 1, ...].
        self.stats = StagingStats.allocate(rows, layout.num_layers, H, P, D, self.device)
        # Dynamic reference mode (profile dynamic:<rho>): full rows, Eq. 3 picks the kept tokens.
        # row_keep[l]: [num_pages, H, P] bool, indexed by logical page; False = dropped (masked).
        self.dynamic_rho = dynamic_rho
        self.row_keep: list[torch.Tensor] | None = None
        if dynamic_rho is not None:
            if layout.high is not None or any(t.hi != P for layer in layout.tiers for t in layer):
                raise ValueError("the dynamic reference mode needs full-size, full-precision rows "
                                 "(budgets of 1.0, --ragged-precision bf16)")
            self.row_keep = [torch.zeros(num_pages, H, P, dtype=torch.bool, device=self.device)
                             for _ in range(layout.num_layers)]
        # page_to_stage: [num_pages] int64, staging page of a logical page or -1 (CPU bookkeeping).
        self.page_to_stage = torch.full((num_pages,), -1, dtype=torch.long)
        # stage_owner: [S] int64 logical page held by a staging page or -1.
        self.stage_owner = torch.full((num_staging_pages,), -1, dtype=torch.long)
        self.free_stage: list[int] = list(range(num_staging_pages - 1, -1, -1))
        # sealed: [num_pages] bool, the page's rows hold its compressed KV.
        self.sealed = torch.zeros(num_pages, dtype=torch.bool)
        self.counters = SealCounters()  # counted by seal, count_sealed and mark_sealed
        # The one sealer of the server (its decisions; the storage writes what it selects).
        self.sealer = Sealer(layout, scorer, TierRows() if dynamic_rho is None else DynamicRows(dynamic_rho))
        self._row_writer: RowWriter | None = None  # None: the storage's own (_write_rows)
        # native_rows: the storage's own writes of TierRows selections go through the native
        # kernels' seal_rows (one call a layer; the same bits as the torch writes, which
        # tests/unit/test_native_seal.py holds it to) on a CPU where they are built; False: the
        # torch ops (tests and bench.seal compare the two).
        self.native_rows = self.device.type == "cpu" and native_kernels() is not None
        # native_stats: store_stats in one native call (the same values as StagingStats.store;
        # tests/unit/test_storage.py compares them) where the kernels are built.
        self.native_stats = self.native_rows
        self._seal_args: dict[int, tuple[list[int], list[int], list[torch.Tensor]]] = {}
        # The CUDA stream the latest forward ran on (`follow_forward`); None on a CPU.
        self._forward_stream: torch.cuda.Stream | None = None
        # The CUDA stream SGLang's scheduler writes req_to_token on (`follow_scheduler`).
        self._scheduler_stream: torch.cuda.Stream | None = None

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def _tiers(self, fmt: Callable[[int, int], LowPrecision | None], num_pages: int,
               tokens: Callable[[RowTiers], int]) -> list[list[QuantTier | None]]:
        """[L][G] zeroed quantized tiers of `tokens(tiers)` slots in `fmt(layer, group)` (None
        where 0)."""
        layout = self.layout

        def tier(li: int, g: int, heads: tuple[int, ...], t: RowTiers) -> QuantTier | None:
            f = fmt(li, g)
            if f is None or not tokens(t):
                return None
            return empty_tier(f, num_pages, tokens(t), len(heads), layout.head_dim, self.device)

        return [[tier(li, g, heads, t) for g, (heads, t) in enumerate(zip(gs, ts, strict=True))]
                for li, (gs, ts) in enumerate(zip(layout.groups, layout.tiers, strict=True))]

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def num_staging_pages(self) -> int:
        return self.stage_owner.numel()

    @property
    def scratch_stage(self) -> int:
        """The staging page no logical page ever holds (padding writes of captured graphs)."""
        return self.num_staging_pages

    @property
    def staging_in_use(self) -> int:
        return self.num_staging_pages - len(self.free_stage)

    def nbytes(self) -> int:
        tensors = [t for rows in (self.rows_k, self.rows_v) for layer in rows for t in layer]
        tensors += [t for rows in (self.low_rows, self.high_rows) for layer in rows
                    for tier in layer if tier is not None for t in tier.tensors()]
        tensors += self.row_keep or []
        tensors += self.stage_k + self.stage_v + self.stats.tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- staging pages ----------------------------------------------------------------------

    def stage(self, page: int) -> int:
        """Give logical page `page` a zeroed staging page; returns the staging page."""
        if self.page_to_stage[page] >= 0:
            raise RuntimeError(f"logical page {page} is already staged")
        if not self.free_stage:
            raise StagingExhaustedError(
                f"all {self.num_staging_pages} staging pages are in use; lower "
                "--max-running-requests or --ragged-window-pages"
            )
        s = self.free_stage.pop()
        self.stage_owner[s] = page
        self.page_to_stage[page] = s
        self.sealed[page] = False
        self.stats.reset(s)
        return s

    def unstage(self, pages: torch.Tensor) -> None:
        """Return the staging pages of these logical pages (those that have one)."""
        stages = self.page_to_stage[pages]
        held = stages >= 0
        for s in stages[held].tolist():
            self.stage_owner[s] = -1
            self.free_stage.append(s)
        self.page_to_stage[pages[held]] = -1

    def on_pages_freed(self, pages: torch.Tensor) -> None:
        """SGLang's allocator freed these logical pages: drop what they held."""
        pages = pages.to("cpu", torch.long)
        self.unstage(pages)
        self.sealed[pages] = False

    def reset(self) -> None:
        """Everything free again (the allocator was cleared, e.g. a cache flush)."""
        self.page_to_stage.fill_(-1)
        self.stage_owner.fill_(-1)
        self.free_stage = list(range(self.num_staging_pages - 1, -1, -1))
        self.sealed.zero_()

    # ---- staging writes ----------------------------------------------------------------------

    def stage_kv(self, layer: int, stages: torch.Tensor, k_pages: torch.Tensor,
                 v_pages: torch.Tensor) -> None:
        """Whole pages k_pages, v_pages [N, P, H, D] (any float dtype) into this layer's
        staging pages stages [N] int64 (distinct)."""
        self.stage_k[layer].index_copy_(0, stages, k_pages.to(self.dtype))
        self.stage_v[layer].index_copy_(0, stages, v_pages.to(self.dtype))

    def stage_tokens(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, copy_rows: RowCopy | None = None) -> None:
        """Tokens k, v [n, H, D] (any float dtype) into this layer's staging slots: slot
        slots[i] (stage * P + offset, distinct) gets row rows[i], zeros where rows[i] < 0 --
        the narrow write of a decode step (tail_batch.stage_fresh), the rest of each staging
        page untouched. copy_rows: how (default index_select and index_copy_; the native path
        passes its C++ copy)."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        for stage, x in ((self.stage_k[layer], k), (self.stage_v[layer], v)):
            flat, x = stage.view(-1, H, D), x.to(self.dtype).contiguous()  # [(S + 1) * P, H, D]
            if copy_rows is not None:
                copy_rows(flat, slots, x, rows)
                continue
            padded = torch.cat([x.new_zeros(1, H, D), x])  # row 0: zeros
            flat.index_copy_(0, slots, padded.index_select(0, rows + 1))

    def store_stats(self, layer: int, stages: torch.Tensor, acc: StagedQueryStats) -> None:
        """One layer's accumulators of the pages that stay staged, stages [N] int64: one
        native call on the CPU where the kernels are built (`native_stats`), else
        StagingStats.store's four index_copy_."""
        if self.native_stats:
            s = self.stats
            native_kernels().store_stats(s.attn, s.q_sum, s.q_sq_sum, s.q_count, layer,
                                         stages.long(), acc.attn.contiguous(),
                                         acc.q_sum.contiguous(), acc.q_sq_sum.contiguous(),
                                         acc.q_count.contiguous())
            return
        self.stats.store(layer, stages, acc)

    def write_obs_pages(self, stages: torch.Tensor, counts: torch.Tensor) -> None:
        """Observation counts [N, P] of N staging pages stages [N] int64 (layer-independent;
        whole pages). A page listed twice (a staged page two requests of the batch share)
        keeps its last counts, as writing them in turn would."""
        last = {s: i for i, s in enumerate(stages.tolist())}
        if len(last) < stages.numel():
            keep = torch.tensor(sorted(last.values()), dtype=torch.long)
            stages, counts = stages[keep], counts[keep]
        self.stats.obs.index_copy_(0, stages.cpu(), counts.to("cpu", torch.float32))  # host

    def write_obs(self, stage: int, counts: torch.Tensor) -> None:
        """Observation counts [n <= P] of one staging page's tokens (layer-independent; the
        rest of the page zero)."""
        self.stats.obs[stage].zero_()
        self.stats.obs[stage, : counts.numel()] = counts.cpu()  # host (StagingStats)

    # ---- sealing: rows, counters, sealed marks ------------------------------------------------

    def use_row_writer(self, writer: RowWriter) -> None:
        """Write sealed rows with `writer` from now on (the Triton path's sealing kernel, whose
        address tables are this storage's tensors)."""
        self._row_writer = writer

    def __deepcopy__(self, memo: dict[int, object]) -> RaggedStorage:
        """A copy with its own tensors (tests' twins); refused with an installed row writer,
        whose tables would still address this storage's rows."""
        if self._row_writer is not None:
            raise TypeError("a storage whose row writer was installed (use_row_writer: the "
                            "Triton path's sealing kernel addresses its tensors) cannot be "
                            "deep-copied; copy it before building the Triton implementation")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            # a stream is the device's, not the storage's: the twin follows the same one
            streams = ("_forward_stream", "_scheduler_stream")
            setattr(new, name, value if name in streams else copy.deepcopy(value, memo))
        return new

    # ---- the forwards' stream (CUDA) ----------------------------------------------------------

    def follow_forward(self) -> None:
        """Called as every forward is planned: remember the CUDA stream it runs on. Writes
        from outside a forward (`seal_staged`, which SGLang's result processing calls) go on
        that stream, after the forward in flight: under SGLang's overlap scheduler a batch's
        results are processed while the next batch's forward runs, and that forward reads and
        updates the same requests' staging pages (a finished request decodes once more there).
        Nothing to do on a CPU, where every op has finished when it returns."""
        if self.device.type == "cuda":
            self._forward_stream = torch.cuda.current_stream(self.device)

    def follow_scheduler(self) -> None:
        """Called from the scheduler's batch preparation (serving's prepare_for_extend hook):
        remember the CUDA stream SGLang's scheduler runs on, where it writes req_to_token.
        Planning reads a batch's req_to_token rows behind that stream (`scheduler_stream`)
        instead of behind the forward in flight. Nothing to do on a CPU."""
        if self.device.type == "cuda":
            self._scheduler_stream = torch.cuda.current_stream(self.device)

    @property
    def scheduler_stream(self) -> torch.cuda.Stream | None:
        """The stream `follow_scheduler` recorded (None: not recorded, or a CPU)."""
        return self._scheduler_stream

    def _after_forwards(self) -> contextlib.AbstractContextManager[object]:
        """The context for work queued behind the forwards (see `follow_forward`)."""
        if self._forward_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._forward_stream)

    def seal(self, layer: int, batch: SealBatch) -> None:
        """Seal N pages of one layer: the sealer selects, the row writer writes, `batch.count`
        pages are counted (0 inside a captured decode graph: graph.py counts at load)."""
        selection = self.sealer.select(batch.stats, batch.page_start)
        self.write_sealed(layer, batch.pages, batch.stats.keys, batch.stats.values, selection)
        self.count_sealed(layer, batch.count, selection)

    def write_sealed(self, layer: int, pages: torch.Tensor, k_tok: torch.Tensor,
                     v_tok: torch.Tensor, selection: Selection) -> None:
        """The rows of full pages of one layer as `selection` says (RowWriter's arguments)."""
        writer = self._write_rows if self._row_writer is None else self._row_writer
        writer(layer, pages, k_tok, v_tok, selection)

    def count_sealed(self, layer: int, num_pages: int, selection: Selection | None = None) -> None:
        """Count the entries of `num_pages` pages of one layer written into their rows."""
        kept, seen = self.sealer.entries(layer, num_pages, selection)
        self.counters.entries_kept += kept
        self.counters.entries_seen += seen

    def seal_staged(self, pages: torch.Tensor, page_start: torch.Tensor) -> None:
        """Seal staged pages in every layer from their staging copies (outside a forward pass,
        e.g. at finish), then mark them sealed. pages, page_start: [N] int64 (CPU)."""
        if pages.numel() == 0:
            return
        with self._after_forwards():  # on CUDA: behind the forward in flight (follow_forward)
            # host tensors in one pinned copy that does not wait (a pageable one would block
            # the host until the forward in flight is done); the counts serve every layer
            held = self.page_to_stage[pages]
            obs, stages, rows, starts = to_device(
                [self.stats.obs.index_select(0, held), held, pages, page_start], self.device)
            for layer in range(self.layout.num_layers):
                keys, values = self.stage_k[layer][stages], self.stage_v[layer][stages]
                stats = page_stats(self.stats.layer(layer, stages), obs, keys, values, self.scale)
                self.seal(layer, SealBatch(stats, rows, starts, count=pages.numel()))
        self.mark_sealed(pages)

    def _write_rows(self, layer: int, pages: torch.Tensor, k_tok: torch.Tensor,
                    v_tok: torch.Tensor, selection: Selection) -> None:
        """The storage's own row writer: per group, the selected tokens' K/V into the tiers' rows,
        in one native call (`native_rows`) or in torch ops (dynamic mode: whole pages into full
        rows, with the keep masks, in torch)."""
        if selection.keep is not None:
            self.write_full_rows(layer, pages, k_tok, v_tok, selection.keep)
            return
        if self.native_rows:
            heads, groups, tensors = self._native_seal_args(layer)
            native_kernels().seal_rows(k_tok.contiguous(), v_tok.contiguous(),
                                       selection.scores.float().contiguous(),
                                       selection.sinks.contiguous(), pages.long(), heads, groups,
                                       tensors)
            return
        k_rows, v_rows = _token_rows(k_tok), _token_rows(v_tok)  # [N * P * H, D]
        for g, t in enumerate(self.layout.tiers[layer]):
            heads = self.head_index[layer][g]
            hi_idx, lo_idx = tier_tokens(selection, self.head_span[layer][g], t)  # [N, H_p, *]
            rows = _row_index(k_tok.shape, heads, hi_idx)
            self.write_group(layer, g, pages, _take(k_rows, rows), _take(v_rows, rows))
            if t.lo:
                rows = _row_index(k_tok.shape, heads, lo_idx)
                self.write_low(layer, g, pages, _take(k_rows, rows), _take(v_rows, rows))

    def _native_seal_args(self, layer: int) -> tuple[list[int], list[int], list[torch.Tensor]]:
        """seal_rows' description of one layer's groups (cuda_ext/seal.h): their KV heads,
        7 integers a group (heads, hi, lo, high tier bits and is_float, low tier's) and 14
        tensors (rows_k, rows_v, the high and the low tier's six fields, empty where there is
        no such tier or field, as the native attention takes them), built once."""
        if layer not in self._seal_args:
            heads: list[int] = []
            groups: list[int] = []
            tensors: list[torch.Tensor] = []
            for g, (members, t) in enumerate(zip(self.layout.groups[layer], self.layout.tiers[layer],
                                                 strict=True)):
                fmts = [(self.layout.high, self.high_rows[layer][g]),
                        (self.layout.low_format(layer, g), self.low_rows[layer][g])]
                heads += members
                groups += [len(members), t.hi, t.lo]
                tensors += [self.rows_k[layer][g], self.rows_v[layer][g]]
                for fmt, tier in fmts:
                    groups += [0, 0] if tier is None else [fmt.bits, int(fmt.is_float)]
                    tensors += native_fields(tier)
            self._seal_args[layer] = heads, groups, tensors
        return self._seal_args[layer]

    def write_group(self, layer: int, group: int, pages: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """The high tiers k, v [N, hi, H_p, D] of one group's rows at these pages: at the model
        dtype, or quantized in layout.high (keys per channel over the page's hi tokens, values
        per token, as the low tier)."""
        if self.layout.high is not None:
            if k.shape[1]:
                _write_tier(self.high_rows[layer][group], quantize(self.layout.high, k, v), pages)
            return
        self.rows_k[layer][group].index_copy_(0, pages, k.to(self.dtype))
        self.rows_v[layer][group].index_copy_(0, pages, v.to(self.dtype))

    def write_low(self, layer: int, group: int, pages: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
        """Quantize the low tiers k, v [N, lo, H_p, D] of these pages into their rows."""
        fmt = self.layout.low_format(layer, group)
        _write_tier(self.low_rows[layer][group], quantize(fmt, k, v), pages)

    def write_full_rows(self, layer: int, pages: torch.Tensor, k_tok: torch.Tensor,
                        v_tok: torch.Tensor, keep: torch.Tensor) -> None:
        """Dynamic mode: whole pages k_tok, v_tok [N, P, H, D] into full rows, and which
        tokens each head keeps, keep [N, H, P] bool."""
        self.row_keep[layer][pages] = keep
        for g, heads in enumerate(self.head_span[layer]):
            self.rows_k[layer][g][pages] = k_tok[:, :, heads].to(self.dtype)
            self.rows_v[layer][g][pages] = v_tok[:, :, heads].to(self.dtype)

    def mark_sealed(self, pages: torch.Tensor) -> None:
        """All layers of these pages are written: release their staging and count them."""
        pages = pages.to("cpu", torch.long)
        self.unstage(pages)
        self.sealed[pages] = True
        self.counters.pages_sealed += pages.numel()
        self.counters.tokens_sealed += pages.numel() * self.layout.page_size

    # ---- reading ----------------------------------------------------------------------------

    def sealed_kv(self, layer: int, group: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of sealed pages for one group: each [N * k, H_p, D], in page then slot order
        (low-tier slots dequantized)."""
        k, v = self.page_kv(layer, group, pages)
        return k.flatten(0, 1), v.flatten(0, 1)

    def page_kv(self, layer: int, group: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one group's rows at logical pages `pages` (any shape [*]): each
        [*, k, H_p, D] in the storage dtype, hi slots (dequantized if the high tier is
        quantized) then the dequantized lo slots."""
        rows = self.page_tiers(layer, group, pages.reshape(-1))
        ks = [rows.hi_k.view(*pages.shape, *rows.hi_k.shape[1:])]  # [*, hi, H_p, D]
        vs = [rows.hi_v.view(ks[0].shape)]
        for fmt, tier in ((self.layout.high, rows.high), (self.layout.low_format(layer, group), rows.low)):
            if tier is None:
                continue
            tier_k, tier_v = dequantize(fmt, tier, self.dtype)  # [N, n, H_p, D]
            shape = (*pages.shape, *tier_k.shape[1:])
            ks.append(tier_k.view(shape))
            vs.append(tier_v.view(shape))
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, -3), torch.cat(vs, -3)

    def page_tiers(self, layer: int, group: int, pages: torch.Tensor) -> PageTiers:
        """One group's rows at logical pages `pages` [N] as stored: hi slots at the storage
        dtype and the raw low tier (codes and parameters, not dequantized; None without one),
        and the raw quantized high tier where there is one."""

        def take(tier: QuantTier | None) -> QuantTier | None:
            return None if tier is None else QuantTier(
                *(None if t is None else _take(t, pages) for t in tier.fields()))

        return PageTiers(_take(self.rows_k[layer][group], pages), _take(self.rows_v[layer][group], pages),
                         take(self.low_rows[layer][group]), take(self.high_rows[layer][group]))

    def sealed_keep(self, layer: int, group: int, pages: torch.Tensor) -> torch.Tensor | None:
        """Dynamic mode: [N * P, H_p] bool kept flags matching sealed_kv's order; else None."""
        if self.row_keep is None:
            return None
        keep = self.row_keep[layer][pages][:, self.head_index[layer][group]]  # [N, H_p, P]
        return keep.transpose(1, 2).flatten(0, 1)

    def staged_kv(self, layer: int, stages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of staged pages, all heads: each [N * P, H, D] in position order."""
        return self.stage_k[layer][stages].flatten(0, 1), self.stage_v[layer][stages].flatten(0, 1)

    # ---- integrity --------------------------------------------------------------------------

    def check_integrity(self, free_pages: torch.Tensor) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        free_pages: [F] int64 logical pages the allocator holds as free (incl. staged frees).
        Checks: no page is free twice; staging ownership is a bijection between used staging
        pages and staged logical pages; no free page holds a staging page or is sealed; the
        padding page 0 is neither free, staged nor sealed.
        """
        free = free_pages.to("cpu", torch.long)
        assert free.unique().numel() == free.numel(), "a logical page is free twice (double free)"
        assert not (free == 0).any(), "the padding page 0 was freed"
        owners = self.stage_owner[self.stage_owner >= 0]
        assert owners.unique().numel() == owners.numel(), "two staging pages own one logical page"
        used = sorted(s for s in range(self.num_staging_pages) if self.stage_owner[s] >= 0)
        assert sorted(set(range(self.num_staging_pages)) - set(self.free_stage)) == used, (
            "staging free list disagrees with staging owners"
        )
        assert len(set(self.free_stage)) == len(self.free_stage), "a staging page is free twice"
        for s in used:
            assert self.page_to_stage[self.stage_owner[s]] == s, f"staging page {s} lost its page"
        staged = (self.page_to_stage >= 0).nonzero().flatten()
        assert staged.numel() == len(used), "a logical page points at a staging page it does not own"
        assert not (self.sealed & (self.page_to_stage >= 0)).any(), "a page is both sealed and staged"
        assert not (self.page_to_stage[free] >= 0).any(), "a free page still holds a staging page"
        assert not self.sealed[free].any(), "a free page is still marked sealed"
        assert not self.sealed[0] and self.page_to_stage[0] < 0, "the padding page is in use"


def _span(heads: Sequence[int], index: torch.Tensor) -> slice | torch.Tensor:
    """The KV heads of a group as a slice where they are consecutive, else their index."""
    first = heads[0]
    adjacent = list(heads) == list(range(first, first + len(heads)))
    return slice(first, first + len(heads)) if adjacent else index


def _write_tier(tier: QuantTier, q: QuantTier, pages: torch.Tensor) -> None:
    """Store the quantized tiers q of N pages at these logical pages of `tier`."""
    for dst, src in zip(tier.tensors(), q.tensors(), strict=True):
        dst.index_copy_(0, pages, src)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, P, H, D] as [N * P * H, D]: one row per (page, token, head), for `_row_index`."""
    return x.contiguous().view(-1, x.shape[-1])


def _row_index(shape: torch.Size, heads: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The rows of `_token_rows` of an [N, P, H, D] tensor that hold token idx[n, j, i] of head
    heads[j] of page n (idx [N, H_p, k] token offsets per head), as [N, k, H_p]: `_take` of them
    is the selected tokens [N, k, H_p, D]. (On a CPU, index_select of whole rows costs about half
    of a torch.gather whose index is expanded over D.)"""
    N, P, H, _ = shape
    page = torch.arange(N, device=idx.device).view(N, 1, 1)
    return ((page * P + idx) * H + heads.view(1, -1, 1)).transpose(1, 2)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for an int64 index of any shape, through index_select (cheap on a CPU)."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])
