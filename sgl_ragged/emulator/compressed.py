"""The model's loss with a compressed KV cache, offline (BaKlaVa Algorithm 3's objective).

One forward over a sample emulates chunked prefill with page compression exactly as serving
applies it to a prompt: the queries of chunk c attend causally to their own chunk in full and to
the earlier chunks' pages as sealed, i.e. per KV head only the ``slots`` tokens of each page its
scorer ranks best (sinks forced in). The selection runs inside the forward, layer by layer, on
the keys and queries that the compressed lower layers produce, through the same scoring code as
serving (``chunk_page_stats`` + ``Scorer.page_scores`` + ``select_top_k``). As in calibration,
a chunk's observation window scores its pages against the uncompressed prefix (serving scores
them against the sealed rows), and decode is not modelled.

Row tiers (docs/architecture.md, "Row tiers", ``TierSelection``): sealed tokens of the low tier are seen
quantized and dequantized exactly as the server stores them (mem_pool/quant.py, per page and
head), while a chunk's own tokens stay full precision, as in the server's staging pages.
``StockCache`` emulates SGLang's own quantized KV caches (``--kv-cache-dtype`` fp8_e4m3, mxfp8,
fp4_mx_block16, nvfp4: sglang_caches.py; ``StockFp8`` is its fp8_e4m3), the alternatives a GPU
user has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sgl_ragged import budgets as budget_math
from sgl_ragged.emulator.chunks import ChunkingConfig, chunk_page_stats, chunk_sinks
from sgl_ragged.emulator.runner import CaptureRunner, LayerQKV
from sgl_ragged.emulator.sglang_caches import stock_format
from sgl_ragged.mem_pool.quant import dequantize, quantize
from sgl_ragged.mem_pool.tiers import RowTiers
from sgl_ragged.precision import LowPrecision
from sgl_ragged.rotation import Rotation
from sgl_ragged.scoring import SINK_TOKENS, Scorer
from sgl_ragged.scoring.select import select_flat_top_pages, select_tiers, select_top_k


def head_slots(budgets: Sequence[Sequence[float]], groups: Any, page_size: int) -> list[list[int]]:
    """[L][H] tokens each head keeps per sealed page: its group's slots, as serving stores them
    (a group row has the slots of its largest budget, every member head fills them)."""
    slots = budget_math.group_slots(budgets, groups, page_size, min(SINK_TOKENS, page_size))
    out = [[0] * len(layer) for layer in budgets]
    for li, (layer_groups, layer_slots) in enumerate(zip(groups, slots, strict=True)):
        for group, k in zip(layer_groups, layer_slots, strict=True):
            for h in group:
                out[li][h] = k
    return out


class Selection(Protocol):
    """Which tokens of a chunk's pages each head keeps once sealed."""

    def keep(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """scores [N, H, P] of one layer's chunk, sinks [N, P] bool -> keep [N, H, P] bool."""
        ...


@dataclass(frozen=True)
class SlotSelection:
    """Static budgets: head h of layer l keeps its ``slots[l][h]`` best tokens of every page."""

    slots: Sequence[Sequence[int]]  # [L][H] (head_slots)

    def keep(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return slot_keep(scores, self.slots[layer_idx], sinks)


@dataclass(frozen=True)
class FlatTopSelection:
    """The dynamic reference (``dynamic:<rho>``): Eq. 3 over each chunk's pages, all heads of a
    layer ranked together (select_flat_top_pages, as the server's dynamic mode)."""

    rho: float

    def keep(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return select_flat_top_pages(scores, self.rho, sinks)


@dataclass(frozen=True)
class TierSelection:
    """Static row tiers: head h of layer l keeps, of every page, its ``tiers[l][h].hi`` best
    tokens exactly and the next ``.lo`` quantized in ``fmt`` (as the server's rows). With
    ``hi_fmt`` the hi tokens are quantized too, in that format (tiers.compose_mixed: e.g. int8
    over int4, as the server's --ragged-precision int8+int4 stores them).

    With ``rotation`` (rotation.py, offline only so far) each quantized tier is quantized
    rotated: a head's keys and values times its R, quantized and dequantized, times R^T. That
    is exactly what a server storing rotated tiers would compute (queries rotated at attention,
    outputs rotated back): R is orthogonal, so softmax((q R)(K' R)^T)(V' R) R^T, with K' R and
    V' R the dequantized rotated tiers, equals softmax(q K'^T) V' with K', V' rotated back
    here. Exact (hi_fmt None) tokens are not rotated: R R^T is the identity.

    With ``formats`` ([L][H], --ragged-precision mixed) each head's lo tokens are quantized in
    its own format instead of ``fmt``."""

    tiers: Sequence[Sequence[RowTiers]]  # [L][H] (head_tiers)
    fmt: LowPrecision | None
    hi_fmt: LowPrecision | None = None
    rotation: Rotation | None = None
    formats: Sequence[Sequence[LowPrecision | None]] | None = None  # [L][H] (head_tiers)

    def keep(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(scores, dtype=torch.bool)
        for heads, t in _heads_by_tiers(self.tiers[layer_idx]):
            hi, lo = select_tiers(scores[:, heads], t.hi, t.total, sinks)
            keep[:, heads] = _mask(torch.cat([hi, lo], -1), scores.shape[-1])
        return keep

    def sealed_kv(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, P, H, D] of a chunk's pages -> the values its kept tokens are read as
        (each quantized tier dequantized; other entries unchanged, the mask hides them)."""
        k, v = k.clone(), v.clone()
        layer_tiers = self.tiers[layer_idx]
        formats = [self.fmt] * len(layer_tiers) if self.formats is None else self.formats[layer_idx]
        for heads, (t, lo_fmt) in _heads_by_tiers(list(zip(layer_tiers, formats, strict=True))):
            hi, lo = select_tiers(scores[:, heads], t.hi, t.total, sinks)  # [N, H', hi|lo]
            for idx, fmt in ((hi, self.hi_fmt), (lo, lo_fmt)):
                if idx.shape[-1] and fmt is not None:
                    rotate = None if self.rotation is None else (self.rotation, layer_idx)
                    _requantize(fmt, idx, heads, k, v, rotate)
        return k, v


def _requantize(fmt: LowPrecision, idx: torch.Tensor, heads: list[int], k: torch.Tensor,
                v: torch.Tensor, rotate: tuple[Rotation, int] | None = None) -> None:
    """In place: the tokens idx [N, H', n] (per page, of the heads `heads`) of k, v [N, P, H, D]
    replaced by their values quantized as one tier of `fmt` per page and head, dequantized;
    with `rotate` (rotation, layer) quantized rotated and rotated back (TierSelection)."""
    index = idx.transpose(1, 2)[..., None].expand(-1, -1, -1, k.shape[-1])  # [N, n, H', D]
    tier_k = torch.gather(k[:, :, heads], 1, index)
    tier_v = torch.gather(v[:, :, heads], 1, index)
    if rotate is not None:
        rot, layer = rotate
        tier_k, tier_v = rot.apply(tier_k, layer, heads), rot.apply(tier_v, layer, heads)
    deq_k, deq_v = dequantize(fmt, quantize(fmt, tier_k, tier_v), k.dtype)
    if rotate is not None:
        deq_k, deq_v = rot.invert(deq_k, layer, heads), rot.invert(deq_v, layer, heads)
    for dst, src in ((k, deq_k), (v, deq_v)):
        part = dst[:, :, heads]
        part.scatter_(1, index, src)
        dst[:, :, heads] = part


@dataclass(frozen=True)
class StockCache:
    """SGLang's own quantized KV cache (``--kv-cache-dtype <dtype>``: fp8_e4m3, mxfp8,
    fp4_mx_block16, nvfp4; sglang_caches.py): every cached token kept, read back as SGLang
    0.5.23 stores it (fp8_e4m3: cast to float8_e4m3fn, scale 1, as our checkpoint has no KV
    scales)."""

    dtype: str = "fp8_e4m3"

    def __post_init__(self) -> None:
        stock_format(self.dtype)  # checks the name

    def keep(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(scores, dtype=torch.bool)

    def sealed_kv(self, layer_idx: int, scores: torch.Tensor, sinks: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, P, H, D] of a chunk's pages -> the values SGLang's cache reads back."""
        fmt = stock_format(self.dtype)
        return (fmt.roundtrip(k.flatten(0, 1)).view_as(k), fmt.roundtrip(v.flatten(0, 1)).view_as(v))


StockFp8 = StockCache  # the earlier name: StockFp8() is SGLang's fp8_e4m3 cache


def head_tiers(layout_tiers: Any, groups: Any) -> list[list[RowTiers]]:
    """[L][H] tiers of each head: its group's (every member head fills the group's row)."""
    out = []
    for layer_groups, layer_tiers in zip(groups, layout_tiers, strict=True):
        per_head = {h: t for heads, t in zip(layer_groups, layer_tiers, strict=True) for h in heads}
        out.append([per_head[h] for h in range(len(per_head))])
    return out


def _heads_by_tiers(tiers: Sequence[Any]) -> list[tuple[list[int], Any]]:
    """Heads with equal entries (RowTiers, or (RowTiers, format) pairs) together."""
    return [([h for h, x in enumerate(tiers) if x == t], t) for t in sorted(set(tiers), key=repr)]


def _mask(idx: torch.Tensor, page_size: int) -> torch.Tensor:
    """[N, H, k] token offsets -> [N, H, P] bool."""
    out = torch.zeros(*idx.shape[:-1], page_size, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, idx, True)


def slot_keep(scores: torch.Tensor, slots: Sequence[int], sinks: torch.Tensor) -> torch.Tensor:
    """[N, H, P] bool: per page, head h keeps its slots[h] best tokens (select_top_k)."""
    pages, h_kv, p = scores.shape
    keep = torch.zeros(pages, h_kv, p, dtype=torch.bool, device=scores.device)
    for k in sorted(set(slots)):
        heads = [h for h in range(h_kv) if slots[h] == k]
        idx = select_top_k(scores[:, heads], k, sinks)  # [N, len(heads), k]
        sub = torch.zeros(pages, len(heads), p, dtype=torch.bool, device=scores.device)
        keep[:, heads] = sub.scatter_(2, idx, True)
    return keep


def sealed_keep(layer: LayerQKV, layer_idx: int, selection: Selection, scorer: Scorer,
                cfg: ChunkingConfig, scale: float) -> torch.Tensor:  # fmt: skip
    """[H_kv, T] bool: which tokens each head still has once their chunk is sealed. Tokens of
    the last chunk are never sealed before its own queries run: all True."""
    num_tokens, h_kv = layer.k.shape[:2]
    keep = torch.ones(h_kv, num_tokens, dtype=torch.bool, device=layer.k.device)
    p = cfg.page_size
    for start, end in cfg.chunks(num_tokens)[:-1]:
        scores = scorer.page_scores(chunk_page_stats(layer, start, end, cfg, scale))  # [N, H, P]
        sinks = chunk_sinks(start, (end - start) // p, p, scores.device)
        chunk_keep = selection.keep(layer_idx, scores, sinks)
        keep[:, start:end] = chunk_keep.permute(1, 0, 2).reshape(h_kv, end - start)
    return keep


def sealed_layer(layer: LayerQKV, layer_idx: int, selection: Any, scorer: Scorer,
                 cfg: ChunkingConfig, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizing selections: keep [H_kv, T] bool (as sealed_keep) and the K, V [H_kv, T, D]
    that queries of later chunks read for those tokens."""
    num_tokens, h_kv, d = layer.k.shape
    keep = torch.ones(h_kv, num_tokens, dtype=torch.bool, device=layer.k.device)
    k, v = layer.k.clone(), layer.v.clone()  # [T, H, D]
    p = cfg.page_size
    for start, end in cfg.chunks(num_tokens)[:-1]:
        scores = scorer.page_scores(chunk_page_stats(layer, start, end, cfg, scale))  # [N, H, P]
        n = (end - start) // p
        sinks = chunk_sinks(start, n, p, scores.device)
        keep[:, start:end] = selection.keep(layer_idx, scores, sinks).permute(1, 0, 2).reshape(h_kv, end - start)
        k_pages, v_pages = selection.sealed_kv(layer_idx, scores, sinks, k[start:end].view(n, p, h_kv, d),
                                               v[start:end].view(n, p, h_kv, d))
        k[start:end], v[start:end] = k_pages.flatten(0, 1), v_pages.flatten(0, 1)
    return keep, k.transpose(0, 1), v.transpose(0, 1)


def attention_mask(keep: torch.Tensor, cfg: ChunkingConfig) -> torch.Tensor:
    """[H_kv, T, T] bool: query i sees key j iff j <= i and (same chunk, or j is kept)."""
    num_tokens = keep.shape[1]
    pos = torch.arange(num_tokens, device=keep.device)
    chunk = pos // cfg.chunk_size
    causal = pos[None, :] <= pos[:, None]
    same = chunk[None, :] == chunk[:, None]
    return causal[None] & (same[None] | keep[:, None, :])


class CompressedLoss:
    """Next-token loss of a model whose prefill KV cache is compressed per head."""

    def __init__(self, runner: CaptureRunner, scorer: Scorer, cfg: ChunkingConfig) -> None:
        runner.require_lm_head()
        self.runner, self.scorer, self.cfg = runner, scorer, cfg

    def log_probs(self, input_ids: torch.Tensor, selection: Selection | None) -> torch.Tensor:
        """[T - chunk_size - 1, V] float32 log-probabilities of the next token at every
        position after the first chunk (the queries that see sealed pages); ``selection`` None
        runs the full cache."""
        first = self.cfg.chunk_size
        if input_ids.numel() <= first + 1:
            raise ValueError(f"a {input_ids.numel()}-token sample has no token after the first "
                             f"{first}-token chunk; use longer samples or a smaller chunk size")
        attention = None if selection is None else self._attention(selection)
        logits = self.runner.logits(input_ids, attention, start=first)  # [T - first, V]
        return torch.log_softmax(logits[:-1].float(), dim=-1)

    def token_nll(self, input_ids: torch.Tensor, selection: Selection | None) -> torch.Tensor:
        """[T - chunk_size - 1] float64 NLL of each token after the first chunk."""
        return self.nll_of(self.log_probs(input_ids, selection), input_ids)

    def nll_of(self, logp: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """[T - chunk_size - 1] float64 NLL of the tokens ``log_probs(input_ids, ...)`` predicts."""
        targets = input_ids[self.cfg.chunk_size + 1 :].to(logp.device)
        return -logp.gather(1, targets[:, None])[:, 0].double()

    def _attention(self, selection: Selection) -> Any:
        cfg, scorer, scale = self.cfg, self.scorer, self.runner.scale

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [H_q, T, D], k / v [H_kv, T, D] -> [H_q, T, D]
            layer = LayerQKV(q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float())
            if hasattr(selection, "sealed_kv"):
                return _attend_sealed_values(layer, layer_idx, q, k, v)
            keep = sealed_keep(layer, layer_idx, selection, scorer, cfg, scale)
            group = q.shape[0] // k.shape[0]
            mask = attention_mask(keep, cfg).repeat_interleave(group, dim=0)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=mask, scale=scale
            )  # fmt: skip

        def _attend_sealed_values(layer: LayerQKV, layer_idx: int, q: torch.Tensor,
                                  k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Keys [H_kv, 2T, D]: the chunk's own tokens at full precision, then earlier
            # chunks' tokens as the sealed rows hold them.
            keep, k_sealed, v_sealed = sealed_layer(layer, layer_idx, selection, scorer, cfg, scale)
            num_tokens = k.shape[1]
            pos = torch.arange(num_tokens, device=k.device)
            chunk = pos // cfg.chunk_size
            causal = pos[None, :] <= pos[:, None]
            same = chunk[None, :] == chunk[:, None]
            mask = torch.cat([(causal & same)[None].expand(k.shape[0], -1, -1),
                              (causal & ~same)[None] & keep[:, None, :]], dim=2)
            group = q.shape[0] // k.shape[0]
            keys = torch.cat([k, k_sealed.to(k.dtype)], 1).repeat_interleave(group, 0)
            values = torch.cat([v, v_sealed.to(v.dtype)], 1).repeat_interleave(group, 0)
            return torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask.repeat_interleave(group, 0), scale=scale)

        return attend


def token_kl(full: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
    """[T] float64 KL(full || compressed) of two [T, V] log-probability tensors."""
    return (full.exp() * (full - compressed)).sum(-1).double()
