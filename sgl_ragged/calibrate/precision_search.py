"""Per-head precision from calibration (`sgl-ragged profile tiers --precision mixed`): every
(layer, head group) gets its own row composition *and* low format (how many tokens at the model
dtype, how many at int8 / int4 / int2, how many dropped) within one total byte budget, the
profile's drop-only bytes (docs/calibration.md, "Per-head precision").

A full emulator forward per (group, option) is far too slow on a CPU, so the search has three
steps:

1. Sensitivity, once per calibration sample: the model runs with the full cache and its
   per-layer Q/K/V are captured (emulator/runner.py); for every layer, group and option the
   group's attention output over the sealed pages is recomputed with that option alone (the
   same scorer, selection and quantization as serving, emulator/compressed.py) and its error is
   the squared difference after the layer's output projection (the group's columns of o_proj),
   per query after the first chunk (every QUERY_STRIDE-th: the step's cost is in attention).
2. Allocation: one option per group of least summed error within the budget (knapsack.py,
   exact).
3. Validation: the allocation and the uniform rules (tiers.compose at each format) on the
   compressed loss (mean KL per scored token, held-out samples, emulator/compressed.py); the
   best is written into the profile (tiers.precision "mixed", tiers.formats: format version 3).

With a rotation (`--rotation hadamard`, rotation.py) every step sees the rows as the server stores
them under --ragged-rotation hadamard: the sensitivity step rotates a group's queries, keys and
values by their KV heads' matrices before it selects and quantizes (its error rotated back
before o_proj), validation quantizes every tier rotated (TierSelection.rotation), and the profile
records the rotation (tiers.rotation: format version 4), which --ragged-rotation auto serves.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from sgl_ragged.calibrate.knapsack import allocate
from sgl_ragged.calibrate.tier_search import ROTATION_FIX, rotation_record
from sgl_ragged.emulator.lora import lora_record
from sgl_ragged.mem_pool.tiers import RowTiers, compose, tier_bytes
from sgl_ragged.precision import LOW_PRECISIONS, MIXED_PRECISION, LowPrecision
from sgl_ragged.profile import BudgetProfile, ModelShape, ProfileTiers
from sgl_ragged.rotation import ROTATIONS, Rotation, check_rotation, rotation_of
from sgl_ragged.scoring import SINK_TOKENS
from sgl_ragged.stats import mean_se

DEFAULT_FORMATS = ("int8", "int4", "int2")
HI_SHARES = (0.0, 1 / 16, 1 / 8, 1 / 4)  # of a page, model-dtype tokens
LO_SHARES = (1 / 4, 1 / 2, 3 / 4)  # of a page, low-precision tokens (and every token kept)
DROP_SHARES = (1 / 8, 1 / 4, 1 / 2, 1.0)  # of a page, drop-only rows
QUERY_STRIDE = 4  # the sensitivity step scores every 4th query after the first chunk
BASELINE = "rule:int4"  # the uniform candidate the others are compared with (paired)


@dataclass(frozen=True)
class Option:
    """One way a group spends its row: `tiers.hi` tokens at the model dtype, `tiers.lo` in
    `fmt` (None: no low tier)."""

    tiers: RowTiers
    fmt: LowPrecision | None

    def bytes(self, heads: int, head_dim: int, dtype_bytes: int) -> int:
        return tier_bytes(self.tiers, self.fmt, heads, head_dim, dtype_bytes)


def group_options(page_size: int, slots: int, head_dim: int, dtype_bytes: int,
                  formats: Sequence[LowPrecision]) -> list[Option]:
    """The options the search weighs for one group whose budget is `slots` model-dtype slots:
    a grid of (hi, lo) per format (HI_SHARES x LO_SHARES of the page, and every token kept),
    drop-only rows, and each format's default rule at this budget (so the uniform rules are
    always among the allocations). Every option keeps at least the sinks."""
    out: dict[tuple[RowTiers, str | None], Option] = {}

    def add(hi: int, lo: int, fmt: LowPrecision | None) -> None:
        if SINK_TOKENS <= hi + lo <= page_size:
            key = (RowTiers(hi, lo), fmt.name if lo else None)
            out.setdefault(key, Option(RowTiers(hi, lo), fmt if lo else None))

    for fmt in formats:
        for hs in HI_SHARES:
            hi = round(hs * page_size)
            for n in {round(s * page_size) for s in LO_SHARES} | {page_size - hi}:
                add(hi, min(n, page_size - hi), fmt)
        rule = compose(slots, page_size, head_dim, dtype_bytes, fmt, SINK_TOKENS)
        add(rule.hi, rule.lo, fmt)
    for s in DROP_SHARES:
        add(max(SINK_TOKENS, round(s * page_size)), 0, None)
    add(slots, 0, None)
    return list(out.values())


@dataclass(frozen=True)
class PrecisionSearchConfig:
    """What `search_precisions` runs: the model, the formats and the two sample sets."""

    model_path: str
    formats: tuple[str, ...] = DEFAULT_FORMATS
    samples: int = 4  # held-out validation samples (compressed loss)
    seed: int = 11  # as tier_search: held out from calibration, BaKlaVa and bench.offline_loss
    sens_samples: int = 2  # calibration samples of the sensitivity step
    sens_seed: int = 13
    min_tokens: int = 1024
    max_tokens: int = 1536
    page_size: int = 64
    chunk_size: int = 512
    obs_window: int = 32
    dtype_bytes: int = 2
    lora: str | None = None  # a LoRA adapter directory merged into the model (emulator/lora.py)
    rotation: str = ROTATIONS[0]  # "hadamard": search for rows stored rotated (rotation.py)

    def __post_init__(self) -> None:
        check_rotation(self.rotation)
        bad = [f for f in self.formats if f not in LOW_PRECISIONS]
        if bad or not self.formats:
            raise ValueError(f"--formats {list(self.formats)}: each must be one of "
                             f"{sorted(LOW_PRECISIONS)}")
        if self.samples < 1 or self.sens_samples < 1:
            raise ValueError("--samples and --sens-samples must be >= 1")

    @property
    def low_formats(self) -> list[LowPrecision]:
        return [LOW_PRECISIONS[f] for f in self.formats]


Choice = tuple[tuple[Option, ...], ...]  # [L][G]


def search_precisions(profile: BudgetProfile, cfg: PrecisionSearchConfig, progress: bool = True,
                      ) -> tuple[BudgetProfile, list[dict[str, Any]]]:
    """The profile with the best candidate's per-head compositions and formats, and every
    candidate's row (name, bytes fraction, KL mean / SE, paired difference to rule:int4)."""
    from sgl_ragged.emulator.chunks import ChunkingConfig
    from sgl_ragged.emulator.compressed import CompressedLoss
    from sgl_ragged.emulator.runner import CaptureRunner
    from sgl_ragged.emulator.samples import build_samples
    from sgl_ragged.scoring import make_scorer

    runner = CaptureRunner(cfg.model_path, lora=cfg.lora)
    profile.check_model(runner.shape)
    head_dim = runner.shape.head_dim
    rotation = rotation_of(cfg.rotation, head_dim, ROTATION_FIX)
    chunking = ChunkingConfig(cfg.page_size, cfg.chunk_size, cfg.obs_window)
    scorer = make_scorer(str(profile.source.get("scorer", "snapkv")))
    slots = profile.slots_per_group(cfg.page_size, min_slots=SINK_TOKENS)
    options = [[group_options(cfg.page_size, k, head_dim, cfg.dtype_bytes, cfg.low_formats)
                for k in layer] for layer in slots]
    costs = [[o.bytes(len(heads), head_dim, cfg.dtype_bytes) for o in opts]
             for layer_groups, layer_opts in zip(profile.groups, options, strict=True)
             for heads, opts in zip(layer_groups, layer_opts, strict=True)]
    budget = sum(tier_bytes(RowTiers(k), None, len(heads), head_dim, cfg.dtype_bytes)
                 for layer_groups, layer_slots in zip(profile.groups, slots, strict=True)
                 for heads, k in zip(layer_groups, layer_slots, strict=True))
    sens = build_samples(runner.tokenizer, cfg.sens_samples, cfg.sens_seed, cfg.min_tokens,
                         cfg.max_tokens, cfg.page_size)
    errors = sensitivity(runner, scorer, chunking, profile.groups, options, sens, progress, rotation)
    flat_errors = [e for layer in errors for e in layer]
    alloc = allocate(costs, flat_errors, budget)
    picks = iter(alloc.choice)
    knapsack = tuple(tuple(opts[next(picks)] for opts in layer) for layer in options)
    candidates = {"knapsack": knapsack}
    for fmt in cfg.low_formats:
        candidates[f"rule:{fmt.name}"] = tuple(
            tuple(Option(t := compose(k, cfg.page_size, head_dim, cfg.dtype_bytes, fmt, SINK_TOKENS),
                         fmt if t.lo else None) for k in layer) for layer in slots)
    loss = CompressedLoss(runner, scorer, chunking)
    held_out = build_samples(runner.tokenizer, cfg.samples, cfg.seed, cfg.min_tokens,
                             cfg.max_tokens, cfg.page_size)
    kls = validate(loss, profile.groups, candidates, held_out, progress, rotation)
    rows = _rows(profile, cfg, head_dim, candidates, kls, budget)
    best = min(rows, key=lambda r: r["kl"])["name"]
    return with_formats(profile, candidates[best], cfg, best, rows, alloc.error, runner.shape), rows


def sensitivity(runner: Any, scorer: Any, chunking: Any, groups: Any,
                options: Sequence[Sequence[Sequence[Option]]], samples: Sequence[Any],
                progress: bool = True, rotation: Rotation | None = None) -> list[list[list[float]]]:
    """[L][G][option] mean error of each option (module docstring, step 1) over the samples,
    on rows stored rotated by `rotation` where given."""
    errors = [[[0.0] * len(opts) for opts in layer] for layer in options]
    t0 = time.monotonic()
    for si, sample in enumerate(samples, start=1):
        layers = runner.run(sample.input_ids)
        for li, layer in enumerate(layers):
            w_o = runner.output_projection(li)
            for g, heads in enumerate(groups[li]):
                errs = group_errors(layer, list(heads), options[li][g], scorer, chunking,
                                    runner.scale, w_o, None if rotation is None else (rotation, li))
                for i, e in enumerate(errs):
                    errors[li][g][i] += e / len(samples)
            if progress:
                print(f"\rper-head precision: sensitivity sample {si}/{len(samples)}, layer "
                      f"{li + 1}/{len(layers)} ({time.monotonic() - t0:.0f} s)", end="",
                      file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return errors


def group_errors(layer: Any, heads: list[int], options: Sequence[Option], scorer: Any,
                 chunking: Any, scale: float, w_o: torch.Tensor,
                 rotate: tuple[Rotation, int] | None = None) -> list[float]:
    """Each option's error for one group of one layer (module docstring, step 1): layer is a
    LayerQKV of the full-cache forward (q [T, H_q, D], k / v [T, H_kv, D]), w_o the layer's
    o_proj weight [hidden, H_q * D]. With `rotate` (rotation, the layer's global index) the
    group's rows are stored rotated, as the server's --ragged-rotation stores them: its queries,
    keys and values are rotated by their KV heads' matrices before the selection and the
    quantization, and the error is rotated back before o_proj (the scores, dot products, are
    the same either way)."""
    from sgl_ragged.emulator.chunks import chunk_page_stats, chunk_sinks
    from sgl_ragged.emulator.compressed import TierSelection

    num_tokens, h_kv, d = layer.k.shape
    rep = layer.q.shape[1] // h_kv
    q_heads = [h * rep + r for h in heads for r in range(rep)]  # query head h * G + r reads h
    first = chunking.chunk_size
    if num_tokens <= first:
        raise ValueError(f"a {num_tokens}-token sample has no query after the first chunk")
    chunks = chunking.chunks(num_tokens)[:-1]
    p = chunking.page_size
    scored = []
    for start, end in chunks:  # the scorer's page scores of this group's heads, once
        scores = scorer.page_scores(chunk_page_stats(layer, start, end, chunking, scale))
        scored.append((start, end, scores[:, heads], chunk_sinks(start, (end - start) // p, p)))
    q = layer.q[:, q_heads].transpose(0, 1)  # [H_q', T, D]
    k, v = layer.k[:, heads], layer.v[:, heads]  # [T, H', D]
    if rotate is not None:
        rot, li = rotate
        k, v, q = rot.apply(k, li, heads), rot.apply(v, li, heads), _per_query(rot.apply, q, li, heads)
    cols = torch.cat([torch.arange(h * d, (h + 1) * d) for h in q_heads])
    w = w_o[:, cols]  # [hidden, H_q' * D]
    full = _attend(q, k, v, k, v, torch.ones(len(heads), num_tokens, dtype=torch.bool), chunking, scale)
    out = []
    for opt in options:
        sel = TierSelection([[opt.tiers] * len(heads)], opt.fmt)
        keep = torch.ones(len(heads), num_tokens, dtype=torch.bool)
        k_s, v_s = k.clone(), v.clone()
        for start, end, scores, sinks in scored:
            n = (end - start) // p
            keep[:, start:end] = sel.keep(0, scores, sinks).permute(1, 0, 2).reshape(len(heads), end - start)
            kp, vp = sel.sealed_kv(0, scores, sinks, k[start:end].view(n, p, -1, d),
                                   v[start:end].view(n, p, -1, d))
            k_s[start:end], v_s[start:end] = kp.flatten(0, 1), vp.flatten(0, 1)
        diff = _attend(q, k, v, k_s, v_s, keep, chunking, scale) - full  # [H_q', T', D]
        if rotate is not None:
            diff = _per_query(rot.invert, diff, li, heads)
        proj = diff.transpose(0, 1).flatten(1) @ w.T  # [T', hidden]
        out.append(float(proj.square().sum(-1).mean()))
    return out


def _per_query(fn: Any, x: torch.Tensor, layer: int, heads: list[int]) -> torch.Tensor:
    """x [H_q', T, D], query heads ordered by KV head (h * G + r reads `heads[h]`) -> `fn`
    (Rotation.apply or .invert) applied with each query head's KV head."""
    hq, t, d = x.shape
    rep = hq // len(heads)
    per_kv = x.view(len(heads), rep, t, d).permute(1, 2, 0, 3)  # [G, T, H', D]
    return fn(per_kv, layer, heads).permute(2, 0, 1, 3).reshape(hq, t, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_sealed: torch.Tensor,
            v_sealed: torch.Tensor, keep: torch.Tensor, chunking: Any, scale: float) -> torch.Tensor:
    """Chunked-prefill attention of the queries after the first chunk (as CompressedLoss):
    q [H_q', T, D]; k, v [T, H', D] the chunk's own tokens; k_sealed, v_sealed [T, H', D] what
    later chunks read of sealed tokens; keep [H', T] bool. Returns [H_q', T', D] (the queries
    first, first + QUERY_STRIDE, ... with first the chunk size)."""
    num_tokens = k.shape[0]
    pos = torch.arange(num_tokens)
    rows = pos[chunking.chunk_size::QUERY_STRIDE]  # [T'] the scored queries
    chunk = pos // chunking.chunk_size
    causal = pos[None, :] <= rows[:, None]
    same = chunk[None, :] == chunk[rows][:, None]
    mask = torch.cat([(causal & same)[None].expand(k.shape[1], -1, -1),
                      (causal & ~same)[None] & keep[:, None, :]], dim=2)  # [H', T', 2T]
    rep = q.shape[0] // k.shape[1]
    keys = torch.cat([k, k_sealed], 0).transpose(0, 1).repeat_interleave(rep, 0)  # [H_q', 2T, D]
    values = torch.cat([v, v_sealed], 0).transpose(0, 1).repeat_interleave(rep, 0)
    return torch.nn.functional.scaled_dot_product_attention(
        q[:, rows], keys, values, attn_mask=mask.repeat_interleave(rep, 0), scale=scale)


def validate(loss: Any, groups: Any, candidates: dict[str, Choice], samples: Sequence[Any],
             progress: bool = True, rotation: Rotation | None = None) -> dict[str, list[float]]:
    """Each candidate's mean KL per scored token on each held-out sample (emulator), every
    quantized tier rotated by `rotation` where given."""
    from sgl_ragged.calibrate.tier_search import candidate_kls
    from sgl_ragged.emulator.compressed import TierSelection, head_tiers

    selections = {name: TierSelection(head_tiers([[o.tiers for o in layer] for layer in choice], groups),
                                      None, rotation=rotation,
                                      formats=head_tiers([[o.fmt for o in layer] for layer in choice], groups))
                  for name, choice in candidates.items()}
    return candidate_kls(loss, samples, selections, "per-head precision: validation sample", progress)


def _rows(profile: BudgetProfile, cfg: PrecisionSearchConfig, head_dim: int,
          candidates: dict[str, Choice], kls: dict[str, list[float]], budget: int,
          ) -> list[dict[str, Any]]:
    full = sum(2 * len(heads) * cfg.page_size * head_dim * cfg.dtype_bytes
               for layer in profile.groups for heads in layer)
    rows = []
    base = kls.get(BASELINE)
    for name, choice in candidates.items():
        used = sum(o.bytes(len(heads), head_dim, cfg.dtype_bytes)
                   for layer_groups, layer in zip(profile.groups, choice, strict=True)
                   for heads, o in zip(layer_groups, layer, strict=True))
        if used > budget:
            raise AssertionError(f"candidate {name} takes {used} bytes per page, over {budget}")
        kl = mean_se(kls[name])
        row = {"name": name, "bytes": used / full, "kl": kl.mean,
               "kl_se": kl.se if kl.n > 1 else 0.0, "kl_samples": kls[name]}
        if base is not None:
            diff = mean_se([a - b for a, b in zip(kls[name], base, strict=True)])
            row |= {"kl_vs_int4": diff.mean, "kl_vs_int4_se": diff.se if diff.n > 1 else 0.0}
        rows.append(row)
    return rows


def with_formats(profile: BudgetProfile, choice: Choice, cfg: PrecisionSearchConfig,
                 chosen: str, rows: list[dict[str, Any]], proxy_error: float,
                 model: ModelShape) -> BudgetProfile:
    """The profile carrying these [L][G] options as per-head shares and formats (a group
    without a low tier records the commonest format; no reader uses it), the search in stats,
    and the model it was searched on (as `tier_search.with_tiers`)."""
    h = profile.num_kv_heads
    used = [o.fmt.name for layer in choice for o in layer if o.fmt is not None]
    default = max(used, key=used.count) if used else cfg.formats[0]
    hi = [[0.0] * h for _ in range(profile.num_layers)]
    lo = [[0.0] * h for _ in range(profile.num_layers)]
    formats = [[default] * h for _ in range(profile.num_layers)]
    for li, (layer_groups, layer) in enumerate(zip(profile.groups, choice, strict=True)):
        for heads, o in zip(layer_groups, layer, strict=True):
            for head in heads:
                hi[li][head], lo[li][head] = o.tiers.hi / cfg.page_size, o.tiers.lo / cfg.page_size
                formats[li][head] = o.fmt.name if o.fmt is not None else default
    stats = dict(profile.stats)
    stats["tier_search"] = {"precision": MIXED_PRECISION, "chosen": chosen, "formats": list(cfg.formats),
                            "samples": cfg.samples, "seed": cfg.seed, "sens_samples": cfg.sens_samples,
                            "sens_seed": cfg.sens_seed, "page_size": cfg.page_size,
                            "chunk_size": cfg.chunk_size, "dtype_bytes": cfg.dtype_bytes, **lora_record(cfg.lora),
                            **rotation_record(cfg.rotation), "knapsack_proxy_error": proxy_error,
                            "candidates": rows}
    return replace(profile, model=profile.model or model,
                   tiers=ProfileTiers(MIXED_PRECISION, hi, lo, formats, cfg.rotation), stats=stats)
