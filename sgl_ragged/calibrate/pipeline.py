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
from sgl_ragged.calibrate.sources import SOURCES
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
    source: str = "tangram"  # sources.SOURCES: tangram (Eq. 3), kvcompose, baklava
    eval_samples: int = 2  # baklava: samples of the (r, t) search's compressed loss
    reductions: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)  # baklava: r candidates
    quantiles: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)  # baklava: t at these importance quantiles
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
        if self.source not in SOURCES:
            raise ValueError(f"--source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "baklava":
            if self.budget_mode != "margin":
                raise ValueError("--budget-mode applies to tangram and kvcompose (mu + alpha * "
                                 "sigma); BaKlaVa's budgets already spend rho on average")
            if self.eval_samples < 1:
                raise ValueError(f"--eval-samples must be >= 1, got {self.eval_samples}")
            if not all(0.0 <= r < 1.0 for r in self.reductions) or not self.reductions:
                raise ValueError(f"--baklava-reductions must be in [0, 1), got {list(self.reductions)}")
            if not all(0.0 <= q <= 1.0 for q in self.quantiles) or not self.quantiles:
                raise ValueError(f"--baklava-quantiles must be in [0, 1], got {list(self.quantiles)}")
            if self.min_tokens <= self.chunking.chunk_size:
                raise ValueError(
                    f"BaKlaVa's search scores the tokens after the first prefill chunk: --min-tokens "
                    f"({self.min_tokens}) must exceed --chunk-size ({self.chunking.chunk_size})"
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
    if cfg.source == "baklava":
        return _calibrate_baklava(cfg, runner, samples, started, progress)
    scorers = [make_scorer(name) for name in cfg.scorers]
    per_sample = []  # [S] of [S_c, R, L, H]
    for sample in _progress(samples, progress):
        layers = runner.run(sample.input_ids)
        per_sample.append(sample_retention(layers, scorers, cfg.rhos, cfg.chunking, runner.scale, cfg.source))
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


def _calibrate_baklava(cfg: CalibrationConfig, runner: CaptureRunner, samples: list[Any],
                       started: float, progress: bool) -> list[Path]:  # fmt: skip
    """BaKlaVa: head importance over the samples (Algorithm 1), then per scorer and rho the
    (r, t) of Algorithm 2 with the lowest compressed loss on ``eval_samples`` other samples
    (Algorithm 3)."""
    from sgl_ragged.calibrate import sources

    # 1. Importance of every head in every sample: [S, L, H].
    per_sample = torch.stack([
        torch.stack([sources.head_importance(x, runner.scale) for x in runner.run(s.input_ids)])
        for s in _progress(samples, progress, "importance")
    ]).numpy()  # fmt: skip
    importance = per_sample.mean(0)
    # 2. The search, 3. one profile per (scorer, rho) with its best (r, t).
    searched, full_nll = _baklava_search(cfg, runner, importance, progress)
    run = {"seconds": round(time.perf_counter() - started, 1), "device": cfg.device,
           "threads": torch.get_num_threads()}  # fmt: skip
    tasks = [s.task for s in samples]
    tokens = [s.num_tokens for s in samples]
    paths = writer.output_paths(cfg.output, cfg.scorers, cfg.rhos)
    for (name, rho), rows in searched.items():
        source = _source(cfg, make_scorer(name), rho, tasks, tokens)
        best = min(rows, key=lambda row: row["nll"])  # the first of equals: uniform wins ties
        profile = writer.build_baklava_profile(
            runner.shape, importance, per_sample, tasks, best, rows, full_nll, cfg.heads_per_group,
            source, {"run": {**run, "profiles": len(paths)}},
        )  # fmt: skip
        writer.save(profile, paths[name, rho])
    return list(paths.values())


def _baklava_search(cfg: CalibrationConfig, runner: CaptureRunner, importance: Any,
                    progress: bool) -> tuple[dict[tuple[str, float], list[dict[str, Any]]], float]:  # fmt: skip
    """Algorithm 3 over the (r, t) grid for every (scorer, rho): the mean next-token NLL of the
    held-out samples under each candidate's budgets (identical budgets evaluated once). Returns
    the rows per (scorer, rho) and the full cache's NLL."""
    from sgl_ragged import budgets as budget_math
    from sgl_ragged.calibrate import sources
    from sgl_ragged.calibrate.compressed import CompressedLoss, SlotSelection, head_slots

    held_out = build_samples(runner.tokenizer, cfg.eval_samples, cfg.seed + 1, cfg.min_tokens,
                             cfg.max_tokens, cfg.chunking.page_size)  # fmt: skip
    losses = {name: CompressedLoss(runner, make_scorer(name), cfg.chunking) for name in cfg.scorers}

    def mean_nll(name: str, selection: Any) -> float:
        return float(torch.cat([losses[name].token_nll(s.input_ids, selection) for s in held_out]).mean())

    grid = sources.baklava_grid(importance, cfg.reductions, cfg.quantiles)
    jobs = [(name, rho, r, t) for name in cfg.scorers for rho in cfg.rhos for r, t in grid]
    seen: dict[Any, float] = {}  # (scorer, slots) -> mean NLL
    searched: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for name, rho, r, t in _progress(jobs, progress, "BaKlaVa search"):
        budgets = sources.baklava_budgets(importance, rho, r, t)
        groups = [budget_math.cluster_heads(row, cfg.heads_per_group) for row in budgets.tolist()]
        slots = head_slots(budgets.tolist(), groups, cfg.chunking.page_size)
        key = (name, tuple(map(tuple, slots)))
        if key not in seen:
            seen[key] = mean_nll(name, SlotSelection(slots))
        searched.setdefault((name, rho), []).append(
            {"reduction": r, "threshold": t, "nll": round(seen[key], 6),
             "mean_budget": round(float(budgets.mean()), 6)}
        )  # fmt: skip
    return searched, mean_nll(cfg.scorers[0], None)


def _source(cfg: CalibrationConfig, scorer: Any, rho: float, tasks: list[str],
            tokens: list[int]) -> dict[str, Any]:  # fmt: skip
    params = {k: v for k, v in vars(scorer).items() if isinstance(v, int | float | str | bool)}
    baklava = cfg.source == "baklava"  # no margin (Algorithm 2 gives the budgets); a search
    return {
        "kind": "baklava" if baklava else "calibrated",
        "scorer": scorer.name,
        "scorer_params": params,
        "rho": rho,
        **({} if baklava else {"alpha": cfg.alpha}),
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
        "method": cfg.source,
        "selection": SELECTION[cfg.source],
        **({"eval_samples": cfg.eval_samples, "eval_seed": cfg.seed + 1} if baklava else {}),
    }


SELECTION = {
    "tangram": "TANGRAM Eq. 3 per layer and prefill chunk; budgets Eq. 5",
    "kvcompose": "KVCompose Eq. 16-22 (layer-adaptive composite tokens) per prefill chunk; "
                 "budgets Eq. 5 over the per-layer retention",
    "baklava": "BaKlaVa Algorithm 1 (head importance), Algorithm 2 per layer from uniform "
               "rho, (r, t) with the lowest compressed loss on held-out samples (Algorithm 3)",
}


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

