"""``sgl-ragged``: command-line tools around budget profiles.

    sgl-ragged profile show FILE|uniform:R [--model PATH] [--page-size 64]
    sgl-ragged profile plot FILE [-o out.png] [--layers 3 10 20]
    sgl-ragged calibrate ...        (same as python -m sgl_ragged.calibrate)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sgl_ragged.profile import BudgetProfile, ProfileError, resolve_profile, uniform_profile


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
        sub.add_argument("profile", help="profile JSON file, or uniform:<ratio>")
        sub.add_argument("--model", help="HF checkpoint: check the profile against it "
                                         "(and give uniform:<ratio> its shape)")  # fmt: skip
        sub.add_argument("--page-size", type=int, default=64, help="logical page size (default 64)")
    plot.add_argument("-o", "--output", type=Path, help="PNG path (default: next to the profile)")
    plot.add_argument("--layers", type=int, nargs="+", help="layers to draw (default: 3 most varied)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        from sgl_ragged.calibrate.cli import main as calibrate_main

        return calibrate_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        profile = load_profile(args.profile, args.model)
        if args.action == "show":
            from sgl_ragged.calibrate.summary import describe

            print(describe(profile, args.profile, args.page_size))
        else:
            from sgl_ragged.calibrate.plots import plot_profile

            out = args.output or _default_png(args.profile)
            print(plot_profile(profile, out, args.layers, page_size=args.page_size))
    except (ProfileError, ValueError) as exc:
        print(f"sgl-ragged: error: {exc}", file=sys.stderr)
        return 2
    return 0


def load_profile(spec: str, model: str | None) -> BudgetProfile:
    """A profile file (checked against ``model`` if given) or ``uniform:<ratio>``."""
    is_uniform = spec.partition(":")[0].strip().lower() == "uniform"
    if model is None and not is_uniform:
        return BudgetProfile.load(spec)
    model = model or _default_model()
    if model is None:  # uniform without a model: one layer, one head (shape-free numbers)
        from sgl_ragged.profile import parse_uniform_spec

        return uniform_profile(parse_uniform_spec(spec), 1, 1)
    from sgl_ragged.scheduler.server_args import model_shape

    return resolve_profile(spec, model_shape(model))


def _default_model() -> str | None:
    """The default model's checkpoint if it is already built (never builds it here)."""
    from sgl_ragged.models.smollm2 import MARKER, MODEL_NAME, default_cache_dir

    path = default_cache_dir() / "models" / MODEL_NAME
    return str(path) if (path / MARKER).exists() else None


def _default_png(spec: str) -> Path:
    if spec.partition(":")[0].strip().lower() == "uniform":
        return Path(f"profile-{spec.replace(':', '-').strip()}.png")
    return Path(spec).with_suffix(".png")


if __name__ == "__main__":
    raise SystemExit(main())
