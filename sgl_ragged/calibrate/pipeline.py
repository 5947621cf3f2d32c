"""Calibration end to end: settings -> model and samples -> the budget source -> profile files.

The source (sgl_ragged/sources/) turns the run into one profile per (scorer, rho); for TANGRAM
and KVCompose one model run per sample serves every requested scorer and ratio: the scores
depend on the scorer only, and the selection of each ratio is a cheap top-k over the same scores.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from sgl_ragged.budgets import check_heads_per_group
from sgl_ragged.emulator.runner import CaptureRunner
from sgl_ragged.emulator.samples import build_samples
from sgl_ragged.sources import CalibrationRun, make_source, writer
from sgl_ragged.sources.config import CalibrationConfig

T = TypeVar("T")


def calibrate(cfg: CalibrationConfig, progress: bool = True) -> list[Path]:
    """Run the calibration of ``cfg.source`` and write its profiles; returns their paths."""
    started = time.perf_counter()
    runner = CaptureRunner(cfg.model_path, cfg.device, cfg.dtype, cfg.lora)
    check_heads_per_group(runner.shape.num_kv_heads, cfg.heads_per_group)
    samples = build_samples(runner.tokenizer, cfg.samples, cfg.seed, cfg.min_tokens,
                            cfg.max_tokens, cfg.chunking.page_size)  # fmt: skip
    run = CalibrationRun(cfg, runner, samples, started,
                         lambda items, desc: _progress(items, progress, desc))  # fmt: skip
    profiles = make_source(cfg.source).calibrate(run)
    paths = writer.output_paths(cfg.output, cfg.scorers, cfg.rhos)
    for key, profile in profiles.items():
        writer.save(profile, paths[key])
    return list(paths.values())


def _progress(items: list[T], enabled: bool, desc: str = "calibrating") -> Iterable[T]:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with transformers
        return _plain_progress(items, desc) if enabled else items
    return tqdm(items, desc=desc, unit="step", file=sys.stderr, disable=not enabled)


def _plain_progress(items: list[T], desc: str) -> Iterator[T]:
    for i, item in enumerate(items):
        print(f"\r{desc}: {i + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)

