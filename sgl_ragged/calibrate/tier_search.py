"""Row compositions searched on the compressed loss (docs/architecture.md, "Row tiers"), like BaKlaVa's
(r, t) search: a few candidate ways of spending every group's byte budget, each run through the
offline emulator (emulator/compressed.py) on held-out samples, the one closest to the full cache (mean
KL per scored token) written into the profile as its tiers (format version 2).

With a rotation (`--rotation hadamard`) every candidate is scored on rows stored rotated, as the
server stores them under --ragged-rotation hadamard, and the profile records it (tiers.rotation).

Candidates: the default rule (tiers.compose: every token at the low precision when a page of it
fits, upgrading the best with what is left; else the best at the low precision, the rest
dropped) and "share s": s of the budget's bytes on full-precision slots, the rest on as many
low-precision tokens as fit (s = 0 keeps only low-precision tokens; s = 1 is drop only).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sgl_ragged.emulator.lora import lora_record
from sgl_ragged.mem_pool.tiers import RowTiers, compose
from sgl_ragged.precision import LowPrecision, low_precision
from sgl_ragged.profile import BudgetProfile, ModelShape, ProfileTiers
from sgl_ragged.rotation import ROTATIONS, check_rotation, rotation_of
from sgl_ragged.scoring import SINK_TOKENS
from sgl_ragged.stats import mean_se

DEFAULT_SHARES = (0.0, 0.15, 0.3, 0.5, 1.0)
Tiers = tuple[tuple[RowTiers, ...], ...]  # [L][G]


def shared_composition(slots: int, page_size: int, head_dim: int, dtype_bytes: int,
                       fmt: LowPrecision, share: float) -> RowTiers:
    """`share` of the bytes of `slots` full-precision slots spent on full-precision slots (the
    best tokens), the rest on as many low-precision ones as fit; never fewer tokens than the
    sinks (then full precision alone)."""
    hi = min(slots, math.floor(share * slots + 1e-9))
    rest = 2 * (slots - hi) * head_dim * dtype_bytes
    lo = max((n for n in range(page_size - hi + 1) if fmt.tier_bytes(n, 1, head_dim) <= rest), default=0)
    if hi + lo < SINK_TOKENS:
        return RowTiers(slots)
    return RowTiers(hi, lo)


def candidate_tiers(profile: BudgetProfile, page_size: int, head_dim: int, dtype_bytes: int,
                    fmt: LowPrecision, shares: Sequence[float]) -> dict[str, Tiers]:
    """Every candidate's [L][G] tiers: "rule", then "share=<s>" per share."""
    slots = profile.slots_per_group(page_size, min_slots=SINK_TOKENS)

    def each(fn: Any) -> Tiers:
        return tuple(tuple(fn(k) for k in layer) for layer in slots)

    out = {"rule": each(lambda k: compose(k, page_size, head_dim, dtype_bytes, fmt, SINK_TOKENS))}
    for s in shares:
        out[f"share={s:g}"] = each(lambda k, s=s: shared_composition(k, page_size, head_dim, dtype_bytes, fmt, s))
    return out


def candidate_kls(loss: Any, samples: Sequence[Any], selections: dict[str, Any], label: str,
                  progress: bool = True) -> dict[str, list[float]]:
    """Each candidate's mean KL per scored token against the full cache on each held-out sample
    (emulator/compressed.py: `loss` a CompressedLoss, `selections` name -> TierSelection);
    progress on stderr as "<label> i/n"."""
    from sgl_ragged.emulator.compressed import token_kl

    kls: dict[str, list[float]] = {name: [] for name in selections}
    t0 = time.monotonic()
    for i, sample in enumerate(samples, start=1):
        full = loss.log_probs(sample.input_ids, None)
        for name, selection in selections.items():
            kls[name].append(float(token_kl(full, loss.log_probs(sample.input_ids, selection)).mean()))
        if progress:
            print(f"\r{label} {i}/{len(samples)} ({len(selections)} candidates, "
                  f"{time.monotonic() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return kls


@dataclass(frozen=True)
class TierSearchConfig:
    """What `search_tiers` runs: the model, the precision and the held-out samples."""

    model_path: str
    precision: str = "int4"
    shares: tuple[float, ...] = DEFAULT_SHARES
    samples: int = 6
    seed: int = 11  # held out from calibration (seed 0), BaKlaVa (1) and bench.offline_loss (7)
    min_tokens: int = 1024
    max_tokens: int = 1536
    page_size: int = 64
    chunk_size: int = 512
    obs_window: int = 32
    dtype_bytes: int = 2  # bytes of the serving dtype the budgets are spent in (bf16)
    lora: str | None = None  # a LoRA adapter directory merged into the model (emulator/lora.py)
    rotation: str = ROTATIONS[0]  # "hadamard": search for rows stored rotated (rotation.py)

    def __post_init__(self) -> None:
        check_rotation(self.rotation)
        if low_precision(self.precision) is None:
            raise ValueError("--precision must be a low precision (int8, int4, int2, fp8) to search tiers")
        if not self.shares or any(not 0.0 <= s <= 1.0 for s in self.shares):
            raise ValueError(f"--shares must be fractions in [0, 1], got {list(self.shares)}")
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {self.samples}")


def search_tiers(profile: BudgetProfile, cfg: TierSearchConfig, progress: bool = True,
                 ) -> tuple[BudgetProfile, list[dict[str, Any]]]:
    """The profile with the best candidate's tiers, and every candidate's row of the search
    (name, bytes fraction, KL mean and standard error over samples)."""
    from sgl_ragged.emulator.chunks import ChunkingConfig
    from sgl_ragged.emulator.compressed import CompressedLoss, TierSelection, head_tiers
    from sgl_ragged.emulator.runner import CaptureRunner
    from sgl_ragged.emulator.samples import build_samples
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.scoring import make_scorer

    fmt = low_precision(cfg.precision)
    runner = CaptureRunner(cfg.model_path, lora=cfg.lora)
    profile.check_model(runner.shape)
    head_dim = runner.shape.head_dim
    rotation = rotation_of(cfg.rotation, head_dim, ROTATION_FIX)
    chunking = ChunkingConfig(cfg.page_size, cfg.chunk_size, cfg.obs_window)
    loss = CompressedLoss(runner, make_scorer(str(profile.source.get("scorer", "snapkv"))), chunking)
    candidates = candidate_tiers(profile, cfg.page_size, head_dim, cfg.dtype_bytes, fmt, cfg.shares)
    samples = build_samples(runner.tokenizer, cfg.samples, cfg.seed, cfg.min_tokens, cfg.max_tokens,
                            cfg.page_size)
    kls = candidate_kls(loss, samples, {name: TierSelection(head_tiers(tiers, profile.groups), fmt,
                                                            rotation=rotation)
                                        for name, tiers in candidates.items()},
                        "tier search: sample", progress)
    rows = []
    for name, tiers in candidates.items():
        layout = RaggedLayout(cfg.page_size, head_dim, cfg.dtype_bytes, profile.groups,
                              tuple(tuple(t.total for t in layer) for layer in tiers), tiers, fmt)
        kl = mean_se(kls[name])
        rows.append({"name": name, "bytes": layout.retention, "kl": kl.mean,
                     "kl_se": kl.se if kl.n > 1 else 0.0})  # one sample: no spread, 0 in the file
    best = min(rows, key=lambda r: r["kl"])["name"]
    return with_tiers(profile, candidates[best], cfg, best, rows, runner.shape), rows


def with_tiers(profile: BudgetProfile, tiers: Tiers, cfg: TierSearchConfig, chosen: str,
               rows: list[dict[str, Any]], model: ModelShape) -> BudgetProfile:
    """The profile carrying these [L][G] tiers as per-head shares, the search table in stats,
    and the model they were searched on (slots and bytes follow its head_dim: a profile of a
    source that named no model, e.g. `uniform:0.3`, names it from here on)."""
    h = profile.num_kv_heads
    hi = [[0.0] * h for _ in range(profile.num_layers)]
    lo = [[0.0] * h for _ in range(profile.num_layers)]
    for li, (layer_groups, layer_tiers) in enumerate(zip(profile.groups, tiers, strict=True)):
        for heads, t in zip(layer_groups, layer_tiers, strict=True):
            for head in heads:
                hi[li][head], lo[li][head] = t.hi / cfg.page_size, t.lo / cfg.page_size
    stats = dict(profile.stats)
    stats["tier_search"] = {"precision": cfg.precision, "chosen": chosen, "samples": cfg.samples,
                            "seed": cfg.seed, "page_size": cfg.page_size, "chunk_size": cfg.chunk_size,
                            "dtype_bytes": cfg.dtype_bytes, **lora_record(cfg.lora),
                            **rotation_record(cfg.rotation), "candidates": rows}
    return replace(profile, model=profile.model or model,
                   tiers=ProfileTiers(cfg.precision, hi, lo, rotation=cfg.rotation), stats=stats)


ROTATION_FIX = "search with --rotation none for this model"


def rotation_record(name: str) -> dict[str, str]:
    """The search's rotation for its stats record (nothing for "none": older records unchanged)."""
    return {} if name == ROTATIONS[0] else {"rotation": name}

