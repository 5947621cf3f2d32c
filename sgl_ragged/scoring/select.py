"""Per-head top-k selection inside one page, kept in position order."""

from __future__ import annotations

import math

import torch

from sgl_ragged.scoring.base import SINK_TOKENS


def sink_mask(page_start_pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_start_pos: [N] int64 sequence position of each page's first token.
    Returns [N, P] bool, True for the sink tokens (sequence positions < SINK_TOKENS)."""
    offsets = torch.arange(page_size, device=page_start_pos.device)
    return (page_start_pos[:, None] + offsets[None, :]) < SINK_TOKENS


def select_top_k(scores: torch.Tensor, k: int, sinks: torch.Tensor) -> torch.Tensor:
    """Per (page, head) indices of the k best tokens, sinks forced in, ascending positions.

    scores: [N, H, P] float32 token scores of N pages; sinks: [N, P] bool.
    Returns [N, H, k] int64 token offsets within each page, sorted ascending so that kept slots
    stay in position order (deterministic layouts; identity when k == P).
    """
    page_size = scores.shape[-1]
    if k >= page_size:
        return torch.arange(page_size, device=scores.device).expand(*scores.shape[:-1], page_size)
    forced = scores.masked_fill(sinks[:, None, :], float("inf"))
    # A stable descending sort breaks ties towards earlier positions, deterministically.
    order = torch.sort(forced, dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def select_tiers(scores: torch.Tensor, hi: int, total: int, sinks: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (page, head): the `total` best tokens (sinks forced in), split into the `hi` best of
    them and the rest; each tier in ascending positions (docs/architecture.md, "Row tiers").

    scores: [N, H, P] float32; sinks: [N, P] bool. Returns hi_idx [N, H, hi] and lo_idx
    [N, H, total - hi] int64 token offsets. With hi == total this is select_top_k.
    """
    page_size = scores.shape[-1]
    forced = scores.masked_fill(sinks[:, None, :], float("inf"))
    order = torch.sort(forced, dim=-1, descending=True, stable=True).indices[..., :min(total, page_size)]
    return order[..., :hi].sort(dim=-1).values, order[..., hi:].sort(dim=-1).values


def select_flat_top(scores: torch.Tensor, rho: float, sinks: torch.Tensor) -> torch.Tensor:
    """TANGRAM Eq. 3: one layer's tokens kept by a global top-ceil(rho * H * N) over all heads.

    scores: [H, N] float32 token scores of every KV head over the same N tokens (comparable
    across heads); sinks: [N] bool tokens always kept (they count towards the budget).
    Returns keep [H, N] bool; keep.float().mean(1) is each head's implicit retention ratio.
    Ties break towards lower (head, token) flat index, deterministically.
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"target retention rho must be in (0, 1], got {rho}")
    h, n = scores.shape
    budget = min(h * n, max(math.ceil(rho * h * n), int(sinks.sum()) * h))
    forced = scores.masked_fill(sinks[None, :], float("inf")).flatten()
    order = torch.sort(forced, descending=True, stable=True).indices[:budget]
    keep = torch.zeros(h * n, dtype=torch.bool, device=scores.device)
    keep[order] = True
    return keep.view(h, n)


def select_flat_top_pages(scores: torch.Tensor, rho: float, sinks: torch.Tensor) -> torch.Tensor:
    """Eq. 3 over N consecutive pages of one layer (a chunk): all heads' tokens ranked together.

    scores: [N, H, P] float32 page scores; sinks: [N, P] bool (sink_mask).
    Returns keep [N, H, P] bool. Shared by the dynamic serving mode and calibration.
    """
    n, h, p = scores.shape
    flat = scores.transpose(0, 1).reshape(h, n * p)  # [H, N * P] in position order
    keep = select_flat_top(flat, rho, sinks.flatten())
    return keep.view(h, n, p).transpose(0, 1)
