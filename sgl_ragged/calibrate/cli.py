"""Command line of the calibrator: ``python -m sgl_ragged.calibrate`` / ``sgl-ragged-calibrate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sgl_ragged.emulator.chunks import ChunkingConfig
from sgl_ragged.scoring import SCORERS
from sgl_ragged.sources import DEFAULT_SOURCE, SOURCES, make_source
from sgl_ragged.sources.statistics import BUDGET_MODES

DEFAULT_OUTPUT = "calib_profiles/{model}/{prefix}{{scorer}}-rho{{rho}}.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sgl-ragged-calibrate",
        description="Calibrate per-KV-head retention budgets (TANGRAM Eq. 3-5, or KVCompose's "
                    "or BaKlaVa's budgets) and write profiles.",
    )
    p.add_argument("--source", choices=list(SOURCES), default=DEFAULT_SOURCE,
                   help="; ".join(f"{name}: {cls.help}" for name, cls in SOURCES.items()))
    p.add_argument("model", nargs="?", help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_opt", metavar="PATH", help="same as the positional MODEL")
    p.add_argument("--scorer", nargs="+", default=["snapkv"],
                   help=f"scorer(s), one profile each; registered: {', '.join(sorted(SCORERS))}")
    p.add_argument("--rho", "--ratio", nargs="+", type=float, default=[0.3], dest="rho",
                   help="target global retention ratio(s) in (0, 1], one profile each")
    p.add_argument("--samples", type=int, default=50, help="calibration samples (default 50)")
    p.add_argument("--alpha", type=float, default=2.0, help="safety margin: B = mu + alpha*sigma")
    p.add_argument("--budget-mode", choices=BUDGET_MODES, default="margin",
                   help="margin: B = min(1, mu + alpha*sigma) as given (TANGRAM Eq. 5, default); "
                        "mean: alpha chosen so that the mean budget equals rho (equal memory)")
    p.add_argument("--heads-per-group", type=int, default=None, metavar="H_P",
                   help="KV heads per head group (budget-aware clustering; default 1, or all the "
                        "KV heads of a layer for --source kvcompose)")
    for cls in SOURCES.values():
        cls().add_cli_options(p)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (multiple of page size)")
    p.add_argument("--obs-window", type=int, default=32, help="window queries that score a chunk")
    p.add_argument("--min-tokens", type=int, default=1024, help="shortest sample (tokens)")
    p.add_argument("--max-tokens", type=int, default=1536, help="longest sample (tokens)")
    p.add_argument("--output", "--out", dest="output",
                   help="profile file, or a pattern with {scorer} and {rho} "
                        "(default calib_profiles/<model dir>/{scorer}-rho{rho}.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", metavar="DIR", default=None,
                   help="calibrate for a LoRA adapter's requests: the PEFT adapter directory "
                        "(one of the server's --lora-paths), merged into the model as SGLang "
                        "serves it")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sgl_ragged.calibrate.pipeline import CalibrationConfig, calibrate

    model = args.model_opt or args.model
    if model is None:
        from sgl_ragged.models.smollm2 import ensure_smollm2

        model = str(ensure_smollm2())
    source = make_source(args.source)
    output = args.output or DEFAULT_OUTPUT.format(model=Path(model).name.lower(),
                                                  prefix=source.output_prefix)  # fmt: skip
    try:
        heads_per_group = args.heads_per_group
        if heads_per_group is None:
            heads_per_group = source.default_heads_per_group(model)
        cfg = CalibrationConfig(
            model_path=model, output=output, scorers=tuple(args.scorer), rhos=tuple(args.rho),
            samples=args.samples, alpha=args.alpha, budget_mode=args.budget_mode,
            heads_per_group=heads_per_group, source=args.source,
            source_options=source.options_from_args(args),
            chunking=ChunkingConfig(args.page_size, args.chunk_size, args.obs_window),
            min_tokens=args.min_tokens, max_tokens=args.max_tokens, seed=args.seed,
            device=args.device, dtype=args.dtype, lora=args.lora,
        )  # fmt: skip
        paths = calibrate(cfg, progress=not args.quiet)
    except (ValueError, OSError) as exc:  # OSError: a model path transformers cannot load
        print(f"sgl-ragged-calibrate: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0

