"""Token scorers: one implementation shared by serving, calibration and the dynamic reference."""

from __future__ import annotations

from sgl_ragged.scoring.base import SINK_TOKENS, PageStats, Scorer, page_query_stats
from sgl_ragged.scoring.expected_attention import ExpectedAttentionScorer
from sgl_ragged.scoring.h2o import H2OScorer
from sgl_ragged.scoring.keydiff import KeyDiffScorer
from sgl_ragged.scoring.snapkv import SnapKVScorer
from sgl_ragged.scoring.streaming import StreamingScorer

SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (SnapKVScorer, ExpectedAttentionScorer, KeyDiffScorer, H2OScorer, StreamingScorer)
}


def make_scorer(name: str) -> Scorer:
    """Build a scorer by its flag name (default parameters)."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose one of {sorted(SCORERS)}")
    return SCORERS[name]()


__all__ = [
    "SCORERS",
    "SINK_TOKENS",
    "ExpectedAttentionScorer",
    "H2OScorer",
    "KeyDiffScorer",
    "PageStats",
    "Scorer",
    "SnapKVScorer",
    "StreamingScorer",
    "make_scorer",
    "page_query_stats",
]
