"""BaKlaVa (papers/baklava.txt, Algorithms 1-3): head-importance reallocation of a uniform budget.

A head's importance is 1 - the normalized mean cosine similarity between its values v_i and its
attention outputs o_i = softmax(q_i K^T) V (averaged over the query heads of a KV head); per
layer, heads below the importance threshold t lose the fraction r of the uniform budget rho,
and the k = min(n, H - n) most important heads share what the n reduced heads gave up. (r, t)
come from a search over the compressed loss of held-out samples (Algorithm 3,
emulator/compressed.py). The budgets spend rho on average: no margin, no per-sample retention.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sgl_ragged import budgets as budget_math
from sgl_ragged.profile.source import SourceRecord
from sgl_ragged.scoring.snapkv import window_attention_probs
from sgl_ragged.sources.base import BudgetSource, CalibrationRun, ProfileKey, scorer_params_text

if TYPE_CHECKING:
    from sgl_ragged.emulator.runner import CaptureRunner, LayerQKV
    from sgl_ragged.profile import BudgetProfile, ModelShape
    from sgl_ragged.sources.config import CalibrationConfig

DIGITS = 6  # decimals kept for B and the importance
SearchRows = dict[ProfileKey, list[dict[str, Any]]]  # (scorer, rho) -> one row per (r, t)


@dataclass(frozen=True)
class BaKlaVaOptions:
    """Algorithm 3's search (the calibrator's --eval-samples, --baklava-reductions and
    --baklava-quantiles)."""

    eval_samples: int = 2  # held-out samples whose compressed loss picks (r, t)
    reductions: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)  # candidate r
    quantiles: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)  # t at these importance quantiles

    def __post_init__(self) -> None:
        if self.eval_samples < 1:
            raise ValueError(f"--eval-samples must be >= 1, got {self.eval_samples}")
        if not all(0.0 <= r < 1.0 for r in self.reductions) or not self.reductions:
            raise ValueError(f"--baklava-reductions must be in [0, 1), got {list(self.reductions)}")
        if not all(0.0 <= q <= 1.0 for q in self.quantiles) or not self.quantiles:
            raise ValueError(f"--baklava-quantiles must be in [0, 1], got {list(self.quantiles)}")


class BaKlaVaSource(BudgetSource):
    """Algorithm 2's budgets from the mean head importance, at the (r, t) of the lowest
    compressed loss on held-out samples (Algorithm 3)."""

    name = "baklava"
    help = "head importance reallocation, (r, t) searched by compressed loss"
    selection = ("BaKlaVa Algorithm 1 (head importance), Algorithm 2 per layer from uniform "
                 "rho, (r, t) with the lowest compressed loss on held-out samples (Algorithm 3)")
    record_kind = "baklava"
    margin = False  # Algorithm 2 gives the budgets
    options_type = BaKlaVaOptions

    def add_cli_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--eval-samples", type=int, default=2,
                            help="baklava: held-out samples whose compressed loss picks (r, t) (default 2)")
        parser.add_argument("--baklava-reductions", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9],
                            metavar="R", help="baklava: candidate reductions r of low-importance heads")
        parser.add_argument("--baklava-quantiles", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9],
                            metavar="Q", help="baklava: candidate thresholds t at these quantiles of the "
                                              "head importances")  # fmt: skip

    def options_from_args(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"eval_samples": args.eval_samples, "reductions": tuple(args.baklava_reductions),
                "quantiles": tuple(args.baklava_quantiles)}  # fmt: skip

    def check(self, cfg: CalibrationConfig) -> None:
        if cfg.budget_mode != "margin":
            raise ValueError("--budget-mode applies to tangram and kvcompose (mu + alpha * "
                             "sigma); BaKlaVa's budgets already spend rho on average")
        super().check(cfg)
        if cfg.min_tokens <= cfg.chunking.chunk_size:
            raise ValueError(
                f"BaKlaVa's search scores the tokens after the first prefill chunk: --min-tokens "
                f"({cfg.min_tokens}) must exceed --chunk-size ({cfg.chunking.chunk_size})"
            )

    def extra_record(self, cfg: CalibrationConfig) -> dict[str, Any]:
        return {"eval_samples": self.options(cfg).eval_samples, "eval_seed": cfg.seed + 1}

    def calibrate(self, run: CalibrationRun) -> dict[ProfileKey, BudgetProfile]:
        from sgl_ragged.scoring import make_scorer

        cfg, runner = run.cfg, run.runner
        # 1. Importance of every head in every sample: [S, L, H] (Algorithm 1).
        per_sample = torch.stack([
            torch.stack([head_importance(x, runner.scale) for x in runner.run(s.input_ids)])
            for s in run.progress(run.samples, "importance")
        ]).numpy()  # fmt: skip
        importance = per_sample.mean(0)
        # 2. The (r, t) search (Algorithm 3), 3. one profile per (scorer, rho) at its best (r, t).
        searched, full_nll = search(cfg, runner, importance, run.progress)
        stats = {"run": {"seconds": run.seconds(), "device": cfg.device,
                         "threads": torch.get_num_threads(), "profiles": run.num_profiles}}  # fmt: skip
        out = {}
        for (name, rho), rows in searched.items():
            record = self.record(cfg, make_scorer(name), rho, run.tasks, run.tokens)
            best = min(rows, key=lambda row: row["nll"])  # the first of equals: uniform wins ties
            out[name, rho] = build_profile(runner.shape, importance, per_sample, run.tasks, best, rows,
                                           full_nll, cfg.heads_per_group, record, stats)  # fmt: skip
        return out

    def headline(self, record: SourceRecord) -> str:
        return (f"BaKlaVa for {record.get('scorer')} ({scorer_params_text(record)}), rho "
                f"{record.get('rho')}, r {record.get('reduction')}, t {_f(record.get('threshold'))} "
                f"(searched on {record.get('eval_samples')} held-out samples), importance from ")  # fmt: skip

    def summary_lines(self, stats: dict[str, Any]) -> list[str]:
        baklava = stats.get("baklava")
        if not isinstance(baklava, dict):
            return []
        lines = ["", f"BaKlaVa search (mean NLL of held-out tokens after the first chunk; full KV "
                     f"{_f(baklava.get('full_nll'))})", "  r      t      mean B  NLL"]  # fmt: skip
        for row in baklava.get("search", []):
            chosen = "  <- chosen" if (row.get("reduction"), row.get("threshold")) == (
                baklava.get("reduction"), baklava.get("threshold")) else ""
            lines.append(f"  {row.get('reduction'):<5}  {_f(row.get('threshold')):<5}  "
                         f"{_f(row.get('mean_budget'))}   {_f(row.get('nll'))}{chosen}")
        rank = baklava.get("importance_rank_stability")
        if isinstance(rank, dict):
            lines.append(f"importance rank stability across samples: "
                         f"{_f(rank.get('samples_global_mean'))} (all heads), "
                         f"{_f(rank.get('samples_within_layer_mean'))} (within layers)")
        return lines


def _f(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


# ----- Algorithms 1-3 -----------------------------------------------------------------------


def head_importance(layer: LayerQKV, scale: float) -> torch.Tensor:
    """BaKlaVa Algorithm 1 for one layer and prompt: [H_kv] float64 importance in [0, 1].

    Per query head, the mean over tokens of cos(v_i, o_i) with o_i the causal attention output
    of token i, normalized from [-1, 1] to [0, 1]; a KV head takes the mean over its query
    heads; importance = 1 - that similarity.
    """
    t, h_q, _ = layer.q.shape
    h_kv = layer.k.shape[1]
    group = h_q // h_kv
    pos = torch.arange(t, device=layer.q.device)
    probs = window_attention_probs(layer.q, layer.k, pos, pos, scale)  # [T, H_q, T] causal
    v = layer.v.float().repeat_interleave(group, dim=1)  # [T, H_q, D]
    out = torch.einsum("ihj,jhd->ihd", probs, v)  # [T, H_q, D]
    cos = torch.nn.functional.cosine_similarity(out, v, dim=-1, eps=1e-12)  # [T, H_q]
    similarity = (cos.double().mean(0) + 1.0) / 2.0  # [H_q] in [0, 1]
    return 1.0 - similarity.view(h_kv, group).mean(1)


def baklava_budgets(importance: np.ndarray, rho: float, reduction: float, threshold: float) -> np.ndarray:
    """BaKlaVa Algorithm 2 in every layer, from the uniform budget rho. [L, H] -> [L, H].

    Heads with importance < threshold lose ``reduction`` * rho; the k = min(n, H - n) most
    important of the others gain n * reduction * rho / k each; a layer whose heads are all below
    the threshold (or none) keeps rho everywhere. Budgets are capped at 1 (what a capped head
    cannot take is not spent: the mean budget is then below rho).
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"target retention rho must be in (0, 1], got {rho}")
    if not 0.0 <= reduction < 1.0:
        raise ValueError(f"BaKlaVa reduction r must be in [0, 1), got {reduction}")
    importance = np.asarray(importance, dtype=np.float64)
    out = np.full(importance.shape, float(rho))
    heads = importance.shape[1]
    for li, row in enumerate(importance):
        low = [h for h in range(heads) if row[h] < threshold]
        n = len(low)
        if n == 0 or n > heads - 1:
            continue
        # Top-k of the remaining heads by importance (ties towards the lower head index).
        high = sorted((h for h in range(heads) if h not in low), key=lambda h: (-row[h], h))
        k = min(n, heads - n)
        for h in low:
            out[li, h] = rho * (1.0 - reduction)
        for h in high[:k]:
            out[li, h] = rho + n * reduction * rho / k
    return np.minimum(out, 1.0)


def baklava_grid(importance: np.ndarray, reductions: Sequence[float],
                 quantiles: Sequence[float]) -> list[tuple[float, float]]:  # fmt: skip
    """Algorithm 3's parameter configurations: every (r, t) with t at the given quantiles of the
    model's head importances (the paper's grid of absolute thresholds, made model-relative),
    plus (0, 0): uniform, so the search can also conclude that reallocation does not help."""
    values = np.asarray(importance, dtype=np.float64).ravel()
    thresholds = sorted({round(float(np.quantile(values, q)), 9) for q in quantiles})
    grid = [(0.0, 0.0)]
    grid += [(float(r), t) for r in reductions if r > 0 for t in thresholds]
    return grid


def search(cfg: CalibrationConfig, runner: CaptureRunner, importance: np.ndarray,
           progress: Any) -> tuple[SearchRows, float]:  # fmt: skip
    """Algorithm 3 over the (r, t) grid for every (scorer, rho): the mean next-token NLL of the
    held-out samples under each candidate's budgets (identical budgets evaluated once). Returns
    the rows per (scorer, rho) and the full cache's NLL."""
    from sgl_ragged.emulator.compressed import CompressedLoss, SlotSelection, head_slots
    from sgl_ragged.emulator.samples import build_samples
    from sgl_ragged.scoring import make_scorer

    opts = BaKlaVaSource().options(cfg)
    held_out = build_samples(runner.tokenizer, opts.eval_samples, cfg.seed + 1, cfg.min_tokens,
                             cfg.max_tokens, cfg.chunking.page_size)  # fmt: skip
    losses = {name: CompressedLoss(runner, make_scorer(name), cfg.chunking) for name in cfg.scorers}

    def mean_nll(name: str, selection: Any) -> float:
        return float(torch.cat([losses[name].token_nll(s.input_ids, selection) for s in held_out]).mean())

    grid = baklava_grid(importance, opts.reductions, opts.quantiles)
    jobs = [(name, rho, r, t) for name in cfg.scorers for rho in cfg.rhos for r, t in grid]
    seen: dict[Any, float] = {}  # (scorer, slots) -> mean NLL
    searched: SearchRows = {}
    for name, rho, r, t in progress(jobs, "BaKlaVa search"):
        budgets = baklava_budgets(importance, rho, r, t)
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


def build_profile(
    shape: ModelShape, importance: np.ndarray, per_sample: np.ndarray, tasks: Sequence[str],
    best: dict[str, Any], searched: Sequence[dict[str, Any]], full_nll: float,
    heads_per_group: int, source: SourceRecord, extra_stats: dict[str, Any],
) -> BudgetProfile:  # fmt: skip
    """A BaKlaVa profile: Algorithm 2's budgets at the searched (r, t) ``best``, from the mean
    head ``importance`` [L, H] of the samples ``per_sample`` [S, L, H]. The stats keep the
    importance, its rank stability across samples and the whole search."""
    from sgl_ragged.profile import BudgetProfile
    from sgl_ragged.sources import statistics

    r, t = best["reduction"], best["threshold"]
    budgets = np.round(baklava_budgets(importance, source.rho, r, t), DIGITS)
    groups = tuple(budget_math.cluster_heads(row, heads_per_group) for row in budgets.tolist())
    stats = {
        "mean_budget": round(float(budgets.mean()), DIGITS),
        "baklava": {
            "reduction": r,
            "threshold": t,
            "importance": np.round(importance, DIGITS).tolist(),
            "importance_rank_stability": statistics.rank_stability(per_sample, tasks),
            "full_nll": round(full_nll, 6),
            "search": list(searched),
        },
        **extra_stats,
    }
    return BudgetProfile(
        model=shape,
        budgets=budgets.tolist(),
        groups=groups,
        source=source.updated({"reduction": r, "threshold": t}),
        split_ratios=budget_math.split_ratios(budgets.tolist(), groups),
        stats=stats,
    )
