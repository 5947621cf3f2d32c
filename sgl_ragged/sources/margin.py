"""Sources whose budgets are Eq. 5 over per-sample retention: B = min(1, mu + alpha * sigma).

They differ only in how one prefill chunk's scored tokens are selected (``chunk_kept``); the
calibration runs every sample once, records each head's retention under that selection
(``sample_retention``) and writes the margin budgets (writer.py). Their profiles
store the per-sample retention, so ``sgl-ragged profile derive`` can rebuild them with another
margin, budget mode or group size.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sgl_ragged.emulator.chunks import ChunkingConfig, chunk_page_stats, chunk_sinks
from sgl_ragged.profile.source import SourceRecord
from sgl_ragged.sources.base import BudgetSource, CalibrationRun, ProfileKey, scorer_params_text

if TYPE_CHECKING:
    from sgl_ragged.emulator.runner import LayerQKV
    from sgl_ragged.profile import BudgetProfile
    from sgl_ragged.scoring import Scorer


class MarginSource(BudgetSource):
    """A source of Eq. 5 budgets over the retention its per-chunk selection gives each head."""

    margin = True

    @abstractmethod
    def chunk_kept(self, scores: Sequence[torch.Tensor], sinks: torch.Tensor,
                   rhos: Sequence[float]) -> torch.Tensor:  # fmt: skip
        """Tokens each head keeps of one prefill chunk, for each rho.

        scores: [L] of [N, H, P] float32 page scores of the chunk's N pages in every layer;
        sinks: [N, P] bool sink tokens (always kept). Returns [R, L, H] int64 kept counts.
        """

    def calibrate(self, run: CalibrationRun) -> dict[ProfileKey, BudgetProfile]:
        from sgl_ragged.scoring import make_scorer
        from sgl_ragged.sources import writer

        cfg, runner = run.cfg, run.runner
        scorers = [make_scorer(name) for name in cfg.scorers]
        # 1. One model run per sample: every scorer's and rho's retention, [S_c, R, S, L, H].
        per_sample = [
            sample_retention(runner.run(s.input_ids), scorers, cfg.rhos, cfg.chunking, runner.scale, self)
            for s in run.progress(run.samples, "calibrating")
        ]  # fmt: skip
        retention = torch.stack(per_sample, dim=2).numpy()
        stats = {"run": {"seconds": run.seconds(), "profiles": run.num_profiles,
                         "device": cfg.device, "threads": torch.get_num_threads()}}  # fmt: skip
        # 2. Eq. 5 budgets, groups and statistics per (scorer, rho).
        return {
            (scorer.name, rho): writer.build_profile(
                runner.shape, retention[si, ri], run.tasks, run.tokens, cfg.alpha,
                cfg.heads_per_group, self.record(cfg, scorer, rho, run.tasks, run.tokens), stats,
                cfg.budget_mode,
            )  # fmt: skip
            for si, scorer in enumerate(scorers)
            for ri, rho in enumerate(cfg.rhos)
        }

    def headline(self, record: SourceRecord) -> str:
        via = "" if self.unnamed_records else f" ({self.name} budgets)"
        mode = "" if record.get("budget_mode", "margin") == "margin" else (
            " (budget mode mean: the margin that makes the mean budget rho)")  # fmt: skip
        return (f"calibrated{via} with {record.get('scorer')} ({scorer_params_text(record)}), "
                f"rho {record.get('rho')}, alpha {record.get('alpha')}{mode}, ")  # fmt: skip

    def plot_title(self, record: SourceRecord) -> str:
        return (f"{record.get('scorer')} at rho {record.get('rho')}, alpha {record.get('alpha')}, "
                f"{record.get('samples')} samples")  # fmt: skip


def sample_retention(
    layers: Sequence[LayerQKV], scorers: Sequence[Scorer], rhos: Sequence[float],
    cfg: ChunkingConfig, scale: float, selector: MarginSource,
) -> torch.Tensor:  # fmt: skip
    """Per-head retention of one sample: [S_c, R, L, H_kv] float64 kept / offered.

    S_c = len(scorers), R = len(rhos), L = len(layers); one model run serves them all.
    ``selector`` selects each chunk's tokens through ``chunk_kept``: TANGRAM,
    Eq. 3 per layer (heads of a layer compete); KVCompose, the layers compete through their
    composite tokens and every head of a layer keeps the layer's count.
    """
    if not getattr(selector, "margin", False):
        raise ValueError(f"per-sample retention exists for the margin sources (Eq. 5 budgets), "
                         f"not {getattr(selector, 'name', selector)!r}")
    num_tokens, h_kv = layers[0].k.shape[:2]
    kept = torch.zeros(len(scorers), len(rhos), len(layers), h_kv, dtype=torch.int64)
    for start, end in cfg.chunks(num_tokens):
        sinks = chunk_sinks(start, (end - start) // cfg.page_size, cfg.page_size)  # [N, P]
        stats = [chunk_page_stats(layer, start, end, cfg, scale) for layer in layers]
        for si, scorer in enumerate(scorers):
            scores = [scorer.page_scores(st).cpu() for st in stats]  # [L] of [N, H_kv, P]
            kept[si] += selector.chunk_kept(scores, sinks, rhos)
    return kept.double() / num_tokens
