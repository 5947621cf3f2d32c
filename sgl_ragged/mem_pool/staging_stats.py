"""What staged tokens observed while in the recent window: the scorers' accumulators.

One set of tensors indexed by staging page (docs/architecture.md, "One forward pass"), allocated with the staging
pool, zeroed when a page is staged, written by every implementation when its pages stay staged,
read back into `PageStats` when they are sealed, and counted in a staging page's bytes
(layout.staging_bytes_per_page).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from sgl_ragged.scoring import PageStats


@dataclass(frozen=True)
class StagedQueryStats:
    """One layer's per-page accumulators, [N] pages (the fields PageStats takes from them)."""

    attn: torch.Tensor  # [N, H, P] float32 summed GQA-reduced attention each token received
    q_sum: torch.Tensor  # [N, H, D] float32 sum of the window queries that saw the page
    q_sq_sum: torch.Tensor  # [N, H, D] float32 sum of their squares
    q_count: torch.Tensor  # [N] float32 query vectors summed


@dataclass(frozen=True)
class StagingStats:
    """Accumulators of every staging page (row S: the scratch page), all float32. `obs` lives
    on the host whatever the device: the counts are the planner's own (positions and windows,
    no data), written and read back by it every forward, so a GPU never copies them back (a
    device-to-host read there would wait for the forward in flight)."""

    attn: torch.Tensor  # [S + 1, L, H, P] summed GQA-reduced attention received per token
    obs: torch.Tensor  # [S + 1, P] number of queries that observed each token (all layers), host
    q_sum: torch.Tensor  # [S + 1, L, H, D] sums of the queries observed while staged, per KV head
    q_sq_sum: torch.Tensor  # [S + 1, L, H, D] sums of their squares
    q_count: torch.Tensor  # [S + 1, L] how many query vectors were summed

    @classmethod
    def allocate(cls, rows: int, num_layers: int, num_kv_heads: int, page_size: int,
                 head_dim: int, device: torch.device) -> StagingStats:
        L, H, P, D = num_layers, num_kv_heads, page_size, head_dim
        return cls(
            attn=torch.zeros(rows, L, H, P, device=device),
            obs=torch.zeros(rows, P),
            q_sum=torch.zeros(rows, L, H, D, device=device),
            q_sq_sum=torch.zeros(rows, L, H, D, device=device),
            q_count=torch.zeros(rows, L, device=device),
        )

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int) -> int:
        """float32 bytes of one staging page's accumulators (what `allocate` takes per row)."""
        L, H, P, D = num_layers, num_kv_heads, page_size, head_dim
        return 4 * (L * H * P + P + L * (2 * H * D + 1))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reset(self, stage: int) -> None:
        """Zero one staging page's accumulators (it was just handed out)."""
        for t in self.tensors():
            t[stage].zero_()

    def layer(self, layer: int, stages: torch.Tensor) -> StagedQueryStats:
        """What these staging pages [N] accumulated in one layer (copies, index_select)."""
        return StagedQueryStats(
            attn=self.attn[:, layer].index_select(0, stages),
            q_sum=self.q_sum[:, layer].index_select(0, stages),
            q_sq_sum=self.q_sq_sum[:, layer].index_select(0, stages),
            q_count=self.q_count[:, layer].index_select(0, stages),
        )

    def store(self, layer: int, stages: torch.Tensor, stats: StagedQueryStats) -> None:
        """Write one layer's accumulators of pages that stay staged, stages: [N] int64."""
        for dst, src in ((self.attn, stats.attn), (self.q_sum, stats.q_sum),
                         (self.q_sq_sum, stats.q_sq_sum), (self.q_count, stats.q_count)):
            dst[:, layer].index_copy_(0, stages, src)

    def page_stats(self, layer: int, stages: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, scale: float) -> PageStats:
        """PageStats of staged pages [N] of one layer, with their full keys and values
        [N, P, H, D] (what a scorer reads when they are sealed). On CUDA this copies stages to
        the host for their counts; RaggedStorage.seal_staged passes `page_stats` its own."""
        obs = self.obs.index_select(0, stages.cpu()).to(keys.device)
        return page_stats(self.layer(layer, stages), obs, keys, values, scale)


def page_stats(acc: StagedQueryStats, obs: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, scale: float) -> PageStats:
    """PageStats of N pages from their accumulators, observation counts [N, P], keys and
    values [N, P, H, D] and the attention scale."""
    return PageStats(attn_sum=acc.attn, obs_count=obs, keys=keys, values=values,
                     q_sum=acc.q_sum, q_sq_sum=acc.q_sq_sum, q_count=acc.q_count, scale=scale)
