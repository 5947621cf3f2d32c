"""``CalibrationConfig``: the settings of one calibration run (the calibrator's arguments),
which the budget sources read and check (``BudgetSource.check``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.scoring import make_scorer
from sgl_ragged.sources import DEFAULT_SOURCE, SOURCES, make_source, writer
from sgl_ragged.sources.statistics import BUDGET_MODES


@dataclass(frozen=True)
class CalibrationConfig:
    """Everything one calibration run needs (the CLI's arguments)."""

    model_path: str
    output: str  # a file, or a pattern with {scorer} / {rho} when there are several
    scorers: tuple[str, ...] = ("snapkv",)
    rhos: tuple[float, ...] = (0.3,)
    samples: int = 50
    alpha: float = 2.0
    budget_mode: str = "margin"  # statistics.BUDGET_MODES
    heads_per_group: int = 1
    source: str = DEFAULT_SOURCE  # sources.SOURCES: tangram (Eq. 3), kvcompose, baklava
    # The source's own settings by name (its options_type's fields; unset ones default), e.g.
    # {"eval_samples": 1} for baklava; validated by the source in __post_init__.
    source_options: Mapping[str, Any] = field(default_factory=dict)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    min_tokens: int = 1024
    max_tokens: int = 1536
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    lora: str | None = None  # a LoRA adapter directory merged into the model (emulator/lora.py)

    def __post_init__(self) -> None:
        if not self.scorers or not self.rhos:
            raise ValueError("need at least one scorer and one ratio")
        for rho in self.rhos:
            if not 0.0 < rho <= 1.0:
                raise ValueError(f"target retention ratio must be in (0, 1], got {rho}")
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {self.samples}")
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise ValueError(f"--alpha must be a finite number >= 0, got {self.alpha}")
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"--budget-mode must be one of {', '.join(BUDGET_MODES)}, "
                             f"got {self.budget_mode!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not self.chunking.page_size <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"need page size <= --min-tokens <= --max-tokens, got {self.chunking.page_size}, "
                f"{self.min_tokens}, {self.max_tokens}"
            )
        if self.source not in SOURCES:
            raise ValueError(f"--source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        make_source(self.source).check(self)
        for name in self.scorers:
            make_scorer(name)  # unknown names fail here, before the model loads
        writer.output_paths(self.output, self.scorers, self.rhos)
