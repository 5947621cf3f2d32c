"""Sources whose budgets are Eq. 5 over per-sample retention: B = min(1, mu + alpha * sigma).

They differ only in how one prefill chunk's scored tokens are selected (``chunk_kept``); the
calibration runs every sample once, records each head's retention under that selection
(calibrate/retention.py) and writes the margin budgets (calibrate/writer.py). Their profiles
store the per-sample retention, so ``sgl-ragged profile derive`` can rebuild them with another
margin, budget mode or group size.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sgl_ragged.profile.source import SourceRecord
from sgl_ragged.sources.base import BudgetSource, CalibrationRun, ProfileKey, scorer_params_text

if TYPE_CHECKING:
    from sgl_ragged.profile import BudgetProfile


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
        from sgl_ragged.calibrate import writer
        from sgl_ragged.calibrate.retention import sample_retention
        from sgl_ragged.scoring import make_scorer

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
