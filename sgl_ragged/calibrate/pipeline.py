"""Calibration end to end: samples -> model run -> Eq. 3 retention -> one profile per (scorer, rho).

One model run per sample serves every requested scorer and ratio: the scores depend on the
scorer only, and the selection of each ratio is a cheap top-k over the same scores.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from sgl_ragged.budgets import check_heads_per_group
from sgl_ragged.calibrate import writer
from sgl_ragged.calibrate.corpus import CORPUS_NAME, TASK_NAMES
from sgl_ragged.calibrate.retention import ChunkingConfig, sample_retention
from sgl_ragged.calibrate.runner import CaptureRunner
from sgl_ragged.calibrate.samples import build_samples
from sgl_ragged.calibrate.statistics import BUDGET_MODES
from sgl_ragged.scoring import make_scorer

T = TypeVar("T")


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
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    min_tokens: int = 1024
    max_tokens: int = 1536
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

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
        for name in self.scorers:
            make_scorer(name)  # unknown names fail here, before the model loads
        writer.output_paths(self.output, self.scorers, self.rhos)


def calibrate(cfg: CalibrationConfig, progress: bool = True) -> list[Path]:
    """Run the calibration and write its profiles; returns their paths."""
    started = time.perf_counter()
    runner = CaptureRunner(cfg.model_path, cfg.device, cfg.dtype)
    check_heads_per_group(runner.shape.num_kv_heads, cfg.heads_per_group)
    samples = build_samples(runner.tokenizer, cfg.samples, cfg.seed, cfg.min_tokens,
                            cfg.max_tokens, cfg.chunking.page_size)  # fmt: skip
    scorers = [make_scorer(name) for name in cfg.scorers]
    per_sample = []  # [S] of [S_c, R, L, H]
    for sample in _progress(samples, progress):
        layers = runner.run(sample.input_ids)
        per_sample.append(sample_retention(layers, scorers, cfg.rhos, cfg.chunking, runner.scale))
    retention = torch.stack(per_sample, dim=2).numpy()  # [S_c, R, S, L, H]
    seconds = time.perf_counter() - started
    tasks = [s.task for s in samples]
    tokens = [s.num_tokens for s in samples]
    paths = writer.output_paths(cfg.output, cfg.scorers, cfg.rhos)
    for si, scorer in enumerate(scorers):
        for ri, rho in enumerate(cfg.rhos):
            profile = writer.build_profile(
                runner.shape, retention[si, ri], tasks, tokens, cfg.alpha, cfg.heads_per_group,
                _source(cfg, scorer, rho, tasks, tokens),
                {"run": {"seconds": round(seconds, 1), "profiles": len(paths),
                         "device": cfg.device, "threads": torch.get_num_threads()}},
                cfg.budget_mode,
            )  # fmt: skip
            writer.save(profile, paths[scorer.name, rho])
    return list(paths.values())


def _source(cfg: CalibrationConfig, scorer: Any, rho: float, tasks: list[str],
            tokens: list[int]) -> dict[str, Any]:  # fmt: skip
    params = {k: v for k, v in vars(scorer).items() if isinstance(v, int | float | str | bool)}
    return {
        "kind": "calibrated",
        "scorer": scorer.name,
        "scorer_params": params,
        "rho": rho,
        "alpha": cfg.alpha,
        "samples": cfg.samples,
        "corpus": {
            "name": CORPUS_NAME,
            "tasks": {t: tasks.count(t) for t in TASK_NAMES},
            "tokens": [min(tokens), max(tokens)],
            "python": platform.python_version(),
        },
        "seed": cfg.seed,
        "page_size": cfg.chunking.page_size,
        "chunk_size": cfg.chunking.chunk_size,
        "obs_window": cfg.chunking.obs_window,
        "model_path_name": Path(cfg.model_path).name,
        "dtype": cfg.dtype,
        "selection": "TANGRAM Eq. 3 per layer and prefill chunk; budgets Eq. 5",
    }


def _progress(items: list[T], enabled: bool) -> Iterable[T]:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with transformers
        return _plain_progress(items) if enabled else items
    return tqdm(items, desc="calibrating", unit="sample", file=sys.stderr, disable=not enabled)


def _plain_progress(items: list[T]) -> Iterator[T]:
    for i, item in enumerate(items):
        print(f"\rcalibrating: sample {i + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)

