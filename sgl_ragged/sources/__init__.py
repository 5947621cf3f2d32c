"""Budget sources: where a calibrated profile's per-head budgets come from.

The registry below is the only place that knows the calibrating sources' names and record
kinds; everything else asks a source (``make_source``, ``source_of``) or a profile's typed
``SourceRecord`` (sgl_ragged/profile/source.py: ``fits_any_model``, ``is_dynamic``).
"""

from __future__ import annotations

from sgl_ragged.profile.source import MODEL_FREE_KINDS, ModelFreeKind, SourceRecord
from sgl_ragged.sources.baklava import BaKlaVaSource
from sgl_ragged.sources.base import BudgetSource, CalibrationRun, ProfileKey
from sgl_ragged.sources.kvcompose import KVComposeSource
from sgl_ragged.sources.margin import MarginSource
from sgl_ragged.sources.tangram import TangramSource

SOURCES: dict[str, type[BudgetSource]] = {
    cls.name: cls for cls in (TangramSource, KVComposeSource, BaKlaVaSource)
}
DEFAULT_SOURCE = TangramSource.name


def make_source(name: str) -> BudgetSource:
    """Build a source by its --source name."""
    if name not in SOURCES:
        raise ValueError(f"unknown budget source {name!r}; choose one of {', '.join(SOURCES)}")
    return SOURCES[name]()


def source_of(record: SourceRecord) -> BudgetSource | None:
    """The source that wrote a profile with this ``source`` record; None for model-free
    profiles (uniform, dynamic) and records no registered source wrote."""
    for cls in SOURCES.values():
        source = cls()
        if source.wrote(record):
            return source
    return None


def derivable(record: SourceRecord, name: str) -> BudgetSource:
    """The margin source that wrote a profile with this ``source`` record, whose stored
    per-sample retention `sgl-ragged profile derive` rebuilds budgets from; a ValueError naming
    the file (``name``) otherwise."""
    source = source_of(record)
    if source is None or not source.margin:
        raise ValueError(f"{name} is not a calibrated profile with its samples; only "
                         f"profiles of sgl-ragged-calibrate's {' and '.join(margin_sources())} "
                         "sources store per-sample retention to derive from (for other BaKlaVa "
                         "budgets, rerun the calibrator with --source baklava)")
    return source


def margin_sources() -> list[str]:
    """Names of the sources whose profiles hold per-sample retention and Eq. 5 budgets."""
    return [name for name, cls in SOURCES.items() if cls.margin]


__all__ = [
    "DEFAULT_SOURCE",
    "MODEL_FREE_KINDS",
    "SOURCES",
    "BaKlaVaSource",
    "BudgetSource",
    "CalibrationRun",
    "KVComposeSource",
    "MarginSource",
    "ModelFreeKind",
    "ProfileKey",
    "SourceRecord",
    "TangramSource",
    "derivable",
    "make_source",
    "margin_sources",
    "source_of",
]
