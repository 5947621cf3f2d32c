"""The budget-source interface: where a calibrated profile's per-head budgets come from."""

from __future__ import annotations

import argparse
import platform
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from sgl_ragged.emulator.lora import lora_record
from sgl_ragged.profile.source import SourceRecord

if TYPE_CHECKING:
    from sgl_ragged.emulator.runner import CaptureRunner
    from sgl_ragged.emulator.samples import Sample
    from sgl_ragged.profile import BudgetProfile
    from sgl_ragged.scoring import Scorer
    from sgl_ragged.sources.config import CalibrationConfig

T = TypeVar("T")
ProfileKey = tuple[str, float]  # (scorer name, rho): one profile each


@dataclass(frozen=True)
class CalibrationRun:
    """What a source calibrates from: the settings, the loaded model and the samples."""

    cfg: CalibrationConfig
    runner: CaptureRunner
    samples: Sequence[Sample]
    started: float  # time.perf_counter() when the run began
    progress: Callable[[Sequence[Any], str], Iterable[Any]]  # (items, what) -> items, reported

    @property
    def tasks(self) -> list[str]:
        return [s.task for s in self.samples]

    @property
    def tokens(self) -> list[int]:
        return [s.num_tokens for s in self.samples]

    @property
    def num_profiles(self) -> int:
        """Profiles the run writes: one per distinct (scorer, rho)."""
        return len({(s, r) for s in self.cfg.scorers for r in self.cfg.rhos})

    def seconds(self) -> float:
        """Seconds since the run began, rounded as the profiles record them."""
        return round(time.perf_counter() - self.started, 1)


@dataclass(frozen=True)
class NoOptions:
    """The options of a source that has none of its own."""


class BudgetSource(ABC):
    """Where a calibrated profile's per-(layer, KV head) budgets come from: TANGRAM's Eq. 3-5,
    KVCompose's layer budgets or BaKlaVa's head-importance reallocation (docs/calibration.md).

    A source has a ``--source`` name, its own CLI options and checks, and ``calibrate``, which
    turns a run into one profile per (scorer, rho); its profiles' ``source`` records say which
    source wrote them (``wrote``), and the tools that read a profile (``profile show|plot|derive``)
    ask the source through the methods below instead of comparing names. The server never
    asks: a profile is a profile wherever its budgets come from. Adding a source is one
    subclass in its own file plus its row in ``SOURCES`` (sources/__init__.py), as for scorers.
    """

    name: ClassVar[str]  # --source value; the record's "method"
    help: ClassVar[str]  # what --source <name> does, one line
    selection: ClassVar[str]  # how the budgets are derived (the record's "selection")
    record_kind: ClassVar[str] = "calibrated"  # the record's "kind"
    margin: ClassVar[bool] = False  # B = mu + alpha * sigma from stored per-sample retention
    unnamed_records: ClassVar[bool] = False  # records without "method" (older files) are its
    # Its own settings: a frozen dataclass validated in __post_init__, built from
    # CalibrationConfig.source_options (the CLI fills those through options_from_args).
    options_type: ClassVar[type] = NoOptions

    @property
    def output_prefix(self) -> str:
        """What precedes "<scorer>-rho<rho>.json" in the calibrator's default file names."""
        return f"{self.name}-"

    # ----- command line and settings ------------------------------------------------

    def add_cli_options(self, parser: argparse.ArgumentParser) -> None:  # noqa: B027 (optional)
        """Add this source's own options (the calibrator accepts every source's options)."""

    def options_from_args(self, args: argparse.Namespace) -> dict[str, Any]:
        """``CalibrationConfig.source_options`` from this source's command-line options."""
        return {}

    def options(self, cfg: CalibrationConfig) -> Any:
        """This source's typed options (``options_type``) from ``cfg.source_options``; a
        ValueError naming what is wrong (an option another source takes, a bad value)."""
        known = {f.name for f in fields(self.options_type)}
        unknown = sorted(set(cfg.source_options) - known)
        if unknown:
            raise ValueError(f"--source {self.name} takes no option {', '.join(unknown)} "
                             f"(its options: {', '.join(sorted(known)) or 'none'})")
        return self.options_type(**cfg.source_options)

    def check(self, cfg: CalibrationConfig) -> None:
        """Raise ValueError naming the option when ``cfg`` does not suit this source (its
        options are validated here; sources with more checks extend this)."""
        self.options(cfg)

    def default_heads_per_group(self, model_path: str) -> int:
        """H_p when --heads-per-group is not given."""
        return 1

    # ----- calibration --------------------------------------------------------------

    @abstractmethod
    def calibrate(self, run: CalibrationRun) -> dict[ProfileKey, BudgetProfile]:
        """One profile per (scorer, rho) of ``run.cfg``, keyed by (scorer name, rho)."""

    def record(self, cfg: CalibrationConfig, scorer: Scorer, rho: float, tasks: Sequence[str],
               tokens: Sequence[int]) -> SourceRecord:  # fmt: skip
        """The ``source`` record of the profile for ``scorer`` and ``rho``."""
        from sgl_ragged.emulator.corpus import CORPUS_NAME, TASK_NAMES

        params = {k: v for k, v in vars(scorer).items() if isinstance(v, int | float | str | bool)}
        return SourceRecord(self.record_kind, {
            "scorer": scorer.name,
            "scorer_params": params,
            "rho": rho,
            **({"alpha": cfg.alpha} if self.margin else {}),
            "samples": cfg.samples,
            "corpus": {
                "name": CORPUS_NAME,
                "tasks": {t: list(tasks).count(t) for t in TASK_NAMES},
                "tokens": [min(tokens), max(tokens)],
                "python": platform.python_version(),
            },
            "seed": cfg.seed,
            "page_size": cfg.chunking.page_size,
            "chunk_size": cfg.chunking.chunk_size,
            "obs_window": cfg.chunking.obs_window,
            "model_path_name": Path(cfg.model_path).name,
            **lora_record(cfg.lora),
            "dtype": cfg.dtype,
            "method": self.name,
            "selection": self.selection,
            **self.extra_record(cfg),
        })  # fmt: skip

    def extra_record(self, cfg: CalibrationConfig) -> dict[str, Any]:
        """Record entries of this source's own settings (after the common ones)."""
        return {}

    # ----- reading its profiles ------------------------------------------------------

    def wrote(self, record: SourceRecord) -> bool:
        """Whether this source wrote a profile with this ``source`` record."""
        method = record.get("method", self.name if self.unnamed_records else None)
        return record.kind == self.record_kind and method == self.name

    def describe(self, record: SourceRecord) -> str:
        """The ``source`` line of ``sgl-ragged profile show``."""
        corpus = record.get("corpus", {})
        tasks = ", ".join(f"{t} {n}" for t, n in corpus.get("tasks", {}).items())
        tokens = "-".join(str(t) for t in corpus.get("tokens", []))
        return (
            f"{self.headline(record)}{record.get('samples')} samples of "
            f"{corpus.get('name', '?')} ({tasks}; {tokens} tokens), seed {record.get('seed')}, "
            f"chunk {record.get('chunk_size')}, page {record.get('page_size')}, "
            f"obs window {record.get('obs_window')}"
        )

    @abstractmethod
    def headline(self, record: SourceRecord) -> str:
        """The start of ``describe``: the method, scorer and its settings, ending in ", "."""

    def summary_lines(self, stats: dict[str, Any]) -> list[str]:
        """Lines ``profile show`` adds about what this source stored in the profile's stats."""
        return []

    def plot_title(self, record: SourceRecord) -> str:
        """What ``profile plot`` titles the profile with (after the model)."""
        return f"{record.kind} profile"


def scorer_params_text(record: SourceRecord) -> str:
    """The recorded scorer parameters as "k=v, ..."."""
    return ", ".join(f"{k}={v}" for k, v in record.get("scorer_params", {}).items())
