"""Token scorers: one implementation shared by serving, calibration and the dynamic reference."""

from __future__ import annotations

from sgl_ragged.scoring.base import SINK_TOKENS, PageStats, Scorer
from sgl_ragged.scoring.snapkv import SnapKVScorer

SCORERS: dict[str, type[Scorer]] = {SnapKVScorer.name: SnapKVScorer}


def make_scorer(name: str) -> Scorer:
    """Build a scorer by its flag name."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose one of {sorted(SCORERS)}")
    return SCORERS[name]()


__all__ = ["SCORERS", "SINK_TOKENS", "PageStats", "Scorer", "SnapKVScorer", "make_scorer"]
