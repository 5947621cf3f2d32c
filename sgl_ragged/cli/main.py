"""``sgl-ragged``: command-line tools around budget profiles.

    sgl-ragged profile show FILE|uniform:R|dynamic:R [--model PATH] [--page-size 64]
    sgl-ragged profile plot FILE [-o out.png] [--layers 3 10 20]
    sgl-ragged profile derive FILE -o OUT [--budget-mode mean] [--alpha A] [--heads-per-group N]
    sgl-ragged profile tiers FILE|uniform:R --precision int4 -o OUT [--model PATH] [--samples 6]
    sgl-ragged profile tiers FILE|uniform:R --precision mixed -o OUT [--formats int8 int4 int2]
                                    [--rotation hadamard]
    sgl-ragged calibrate ...        (same as python -m sgl_ragged.calibrate)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sgl_ragged.emulator.lora import check_profile_lora
from sgl_ragged.precision import MIXED_PRECISION
from sgl_ragged.profile import (
    BudgetProfile,
    ProfileError,
    model_free_kind,
    model_free_profile,
    resolve_profile,
)
from sgl_ragged.rotation import ROTATIONS
from sgl_ragged.sources.statistics import BUDGET_MODES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgl-ragged", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("calibrate", add_help=False,
                        help="calibrate budget profiles (see sgl-ragged calibrate --help)")  # fmt: skip
    profile = commands.add_parser("profile", help="inspect a budget profile")
    actions = profile.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print a readable summary")
    plot = actions.add_parser("plot", help="draw retention boxes and memory reclaimed (PNG)")
    for sub in (show, plot):
        sub.add_argument("profile", help="profile JSON file, uniform:<ratio> or dynamic:<rho>")
        sub.add_argument("--model", help="HF checkpoint: check the profile against it "
                                         "(and give uniform:/dynamic: specs its shape)")  # fmt: skip
        sub.add_argument("--page-size", type=int, default=64, help="logical page size (default 64)")
    plot.add_argument("-o", "--output", type=Path, help="PNG path (default: next to the profile)")
    plot.add_argument("--layers", type=int, nargs="+", help="layers to draw (default: 3 most varied)")
    derive = actions.add_parser(
        "derive", help="rebuild a calibrated profile from its stored samples with another "
                       "budget mode, margin or group size (no model run)")  # fmt: skip
    derive.add_argument("profile", help="calibrated profile JSON file")
    derive.add_argument("-o", "--output", type=Path, required=True, help="new profile path")
    derive.add_argument("--budget-mode", choices=BUDGET_MODES, default="margin",
                        help="margin: B = min(1, mu + alpha*sigma); mean: alpha chosen so that "
                             "the mean budget equals the profile's rho")  # fmt: skip
    derive.add_argument("--alpha", type=float,
                        help="margin of --budget-mode margin (default: the profile's)")
    derive.add_argument("--heads-per-group", type=int, help="H_p (default: the profile's)")
    tiers = actions.add_parser(
        "tiers", help="search how each group spends its bytes at a low precision (full-precision "
                      "vs quantized slots) on the compressed loss; writes a version-2 profile "
                      "(version 3 with --precision mixed: a low format per head group; version 4 "
                      "with --rotation hadamard)")  # fmt: skip
    tiers.add_argument("profile", help="profile JSON file or uniform:<ratio>")
    tiers.add_argument("--precision", required=True, help="low precision: int8, int4, int2 or fp8; "
                       "or mixed: search each group's format and composition at the profile's "
                       "total bytes (served with --ragged-precision mixed)")
    tiers.add_argument("--formats", nargs="+", help="--precision mixed: the low formats searched "
                       "(default int8 int4 int2)")
    tiers.add_argument("--heads-per-group", type=int, default=1, help="--precision mixed: H_p of "
                       "the profile searched (default 1: a format and composition per KV head)")
    tiers.add_argument("--sens-samples", type=int, default=2, help="--precision mixed: calibration "
                       "samples of the per-group sensitivity step (default 2)")
    tiers.add_argument("--rotation", choices=ROTATIONS, default=ROTATIONS[0], help="hadamard: "
                       "search for rows stored rotated (--ragged-rotation hadamard, which the "
                       "profile records and --ragged-rotation auto serves); default none")
    tiers.add_argument("-o", "--output", type=Path, required=True, help="new profile path")
    tiers.add_argument("--model", help="HF checkpoint (default: SmolLM2-135M-Instruct, built if needed)")
    tiers.add_argument("--lora", metavar="DIR", help="search for a LoRA adapter's requests: "
                       "its PEFT directory, merged into the model (as sgl-ragged-calibrate --lora)")
    tiers.add_argument("--samples", type=int, default=6, help="held-out samples (default 6)")
    tiers.add_argument("--shares", type=float, nargs="+", help="candidate byte shares of the "
                       "full-precision tier besides the default rule (default 0 0.15 0.3 0.5 1)")
    tiers.add_argument("--page-size", type=int, default=64)
    tiers.add_argument("--chunk-size", type=int, default=512)
    tiers.add_argument("--min-tokens", type=int, default=1024)
    tiers.add_argument("--max-tokens", type=int, default=1536)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        from sgl_ragged.calibrate.cli import main as calibrate_main

        return calibrate_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.action == "derive":
            return _derive(args)
        if args.action == "tiers":
            return _tiers(args)
        profile = load_profile(args.profile, args.model)
        if args.action == "show":
            from sgl_ragged.cli.summary import describe

            print(describe(profile, args.profile, args.page_size))
        else:
            from sgl_ragged.cli.plots import plot_profile

            out = args.output or _default_png(args.profile)
            print(plot_profile(profile, out, args.layers, page_size=args.page_size))
    except (ProfileError, ValueError) as exc:
        print(f"sgl-ragged: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _derive(args: argparse.Namespace) -> int:
    from sgl_ragged.budgets import check_heads_per_group
    from sgl_ragged.sources import derivable
    from sgl_ragged.sources.writer import rebuild_profile, save

    profile = BudgetProfile.load(args.profile)
    derivable(profile.source, Path(args.profile).name)
    alpha = profile.source.get("alpha", 2.0) if args.alpha is None else args.alpha
    heads_per_group = args.heads_per_group or profile.heads_per_group
    check_heads_per_group(profile.num_kv_heads, heads_per_group)
    derived = rebuild_profile(profile, float(alpha), heads_per_group, args.budget_mode,
                              Path(args.profile).name)
    save(derived, args.output)
    print(f"{args.output}: mean B {derived.mean_budget:.4f} (rho {derived.source['rho']}, "
          f"alpha {derived.source['alpha']:g}, budget mode {args.budget_mode}, "
          f"H_p {heads_per_group})")
    return 0


def _tiers(args: argparse.Namespace) -> int:
    from sgl_ragged.calibrate.tier_search import DEFAULT_SHARES, TierSearchConfig, search_tiers
    from sgl_ragged.models.smollm2 import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    if args.precision.lower() == MIXED_PRECISION:
        return _mixed_tiers(args, model)
    cfg = TierSearchConfig(model_path=model, precision=args.precision.lower(),
                           shares=tuple(args.shares or DEFAULT_SHARES), samples=args.samples,
                           page_size=args.page_size, chunk_size=args.chunk_size,
                           min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                           lora=args.lora, rotation=args.rotation)
    profile = load_profile(args.profile, model)
    check_profile_lora(profile.source, args.lora)
    tiered, rows = search_tiers(profile, cfg)
    tiered.save(args.output)
    chosen = tiered.stats["tier_search"]["chosen"]
    for r in rows:
        mark = "  <- chosen" if r["name"] == chosen else ""
        print(f"{r['name']:>12}: bytes {r['bytes']:.3f}, KL {r['kl']:.4f} ± {r['kl_se']:.4f}{mark}")
    print(f"{args.output}: {cfg.precision} tiers ({chosen}) for {args.profile}{_rotated(cfg.rotation)}")
    return 0


def _mixed_tiers(args: argparse.Namespace, model: str) -> int:
    """`profile tiers --precision mixed`: the per-head precision search."""
    from sgl_ragged.calibrate.precision_search import (
        DEFAULT_FORMATS,
        PrecisionSearchConfig,
        search_precisions,
    )

    cfg = PrecisionSearchConfig(model_path=model, formats=tuple(f.lower() for f in args.formats or DEFAULT_FORMATS),
                                samples=args.samples, sens_samples=args.sens_samples,
                                page_size=args.page_size, chunk_size=args.chunk_size,
                                min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                lora=args.lora, rotation=args.rotation)
    profile = load_profile(args.profile, model)
    check_profile_lora(profile.source, args.lora)
    if profile.heads_per_group != args.heads_per_group:
        profile = profile.regrouped(args.heads_per_group)
    tiered, rows = search_precisions(profile, cfg)
    tiered.save(args.output)
    chosen = tiered.stats["tier_search"]["chosen"]
    for r in rows:
        mark = "  <- chosen" if r["name"] == chosen else ""
        vs = (f", vs rule:int4 {r['kl_vs_int4']:+.4f} ± {r['kl_vs_int4_se']:.4f}"
              if "kl_vs_int4" in r else "")
        print(f"{r['name']:>12}: bytes {r['bytes']:.3f}, KL {r['kl']:.4f} ± {r['kl_se']:.4f}{vs}{mark}")
    print(f"{args.output}: per-head precisions ({chosen}) for {args.profile}; serve with "
          f"--ragged-precision {MIXED_PRECISION}{_rotated(cfg.rotation)}")
    return 0


def _rotated(rotation: str) -> str:
    return "" if rotation == ROTATIONS[0] else f" (rows rotated: --ragged-rotation {rotation}, auto)"


def load_profile(spec: str, model: str | None) -> BudgetProfile:
    """A profile file (checked against ``model`` if given), ``uniform:<ratio>`` or
    ``dynamic:<rho>``."""
    if model is None and model_free_kind(spec) is None:
        return BudgetProfile.load(spec)
    model = model or _default_model()
    if model is None:  # a spec without a model: one layer, one head (shape-free numbers)
        return model_free_profile(spec, 1, 1)
    from sgl_ragged.profile import model_shape

    return resolve_profile(spec, model_shape(model))


def _default_model() -> str | None:
    """The default model's checkpoint if it is already built (never builds it here)."""
    from sgl_ragged.models.smollm2 import MARKER, MODEL_NAME
    from sgl_ragged.paths import default_cache_dir

    path = default_cache_dir() / "models" / MODEL_NAME
    return str(path) if (path / MARKER).exists() else None


def _default_png(spec: str) -> Path:
    if model_free_kind(spec) is not None:
        return Path(f"profile-{spec.replace(':', '-').strip()}.png")
    return Path(spec).with_suffix(".png")


if __name__ == "__main__":
    raise SystemExit(main())
