"""The configurations bench.accuracy and bench.offline_loss compare: their grammar (names such as
"static-snapkv@0.3", "int4@0.5", "int8+int4@0.3", "int4r@0.3"), which exist for a profile directory, one
profile file as one named configuration (`profile_config`), and the KV bytes each keeps per
token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL = "full"
PAGE_SIZE = 64  # --page-size of the benchmarks' servers (bench.offline_loss: its --page-size)


@dataclass(frozen=True)
class Config:
    """One server configuration: `kind` in full/uniform/static/static-mean/kvcompose/baklava/
    dynamic."""

    name: str
    kind: str
    rho: float
    scorer: str
    profile: str  # --ragged-profile
    precision: str = "bf16"  # --ragged-precision

    @property
    def is_dynamic(self) -> bool:
        """Whether this is the dynamic reference mode (--ragged-profile dynamic:<rho>)."""
        from sgl_ragged.profile import ModelFreeKind, model_free_kind

        return model_free_kind(self.profile) is ModelFreeKind.DYNAMIC

    def server_args(self) -> list[str]:
        if self.kind == STOCK:  # SGLang's own cache on the CPU backend that stores it, no plugin flags
            from bench.servers import stock_backend

            return ["--attention-backend", stock_backend("cpu", self.precision),
                    "--kv-cache-dtype", self.precision]
        base, rotated = split_rotated(self.precision)  # int4r: int4 rows stored rotated
        return ["--attention-backend", "ragged", "--ragged-profile", self.profile,
                "--ragged-scorer", self.scorer, "--ragged-precision", base,
                "--ragged-rotation", "hadamard" if rotated else "none"]  # never a profile's auto


def precision_configs(rhos: list[float], precisions: list[str], scorer: str, head_dim: int,
                      page_size: int = PAGE_SIZE) -> list[Config]:
    """Row tiers (docs/architecture.md, "Row tiers") at uniform byte budgets: per low precision p, "p@rho"
    spends rho of the bytes by the default composition (tiers.compose: every token at p, the
    best upgraded, or the best at p and the rest dropped), and "p-all@r" keeps every token at p
    and nothing else (r: the budget that buys exactly that, in bf16 bytes). A pair "h+l" (e.g.
    int8+int4, `MIXED_SEP`) gives "h+l@rho": both tiers quantized (tiers.compose_mixed, as the
    server's --ragged-precision h+l stores them). A trailing `ROTATED_SUFFIX` (int4r, int2r,
    int8+int4r) quantizes every quantized tier rotated (rotation.py; same bytes; served with
    --ragged-rotation hadamard), e.g. "int4r@0.3", "int4r-all@0.28125"."""
    from sgl_ragged.precision import low_precision

    configs = []
    for p in precisions:
        base, _ = split_rotated(p)
        if MIXED_SEP in base:
            configs += [Config(f"{p}@{rho}", "tiers-mixed", rho, scorer, f"uniform:{rho}", p)
                        for rho in sorted(rhos) if rho < 1.0]
            continue
        fmt = low_precision(base)
        # A full page of p against a full page at bf16, in whole slots of budget.
        whole = fmt.tier_bytes(page_size, 1, head_dim) / (2 * page_size * head_dim * 2)
        r = round(-(-whole * page_size // 1) / page_size, 6)
        configs.append(Config(f"{p}-all@{r}", "tiers-all", r, scorer, f"uniform:{r}", p))
        configs += [Config(f"{p}@{rho}", "tiers", rho, scorer, f"uniform:{rho}", p)
                    for rho in sorted(rhos) if rho < 1.0]
    return configs


MIXED_SEP = "+"  # "int8+int4": the high tier's format + the low tier's
PER_HEAD = "mixed"  # --precision mixed: mixed-uniform-rho<r>.json of the profile directory
ROTATED_SUFFIX = "r"  # "int4r", "int8+int4r": every quantized tier rotated (rotation.py)


def split_rotated(precision: str) -> tuple[str, bool]:
    """A --precision of the benches -> (its unrotated precision, whether it is rotated):
    "int4r" -> ("int4", True), "int8+int4r" -> ("int8+int4", True), "mixedr" -> ("mixed", True),
    "int4" -> ("int4", False). Checks the name (a low precision, a pair of them or the per-head
    precisions, at most one suffix, at the end)."""
    from sgl_ragged.precision import FULL_PRECISION, LOW_PRECISIONS

    rotated = precision.endswith(ROTATED_SUFFIX)
    base = precision[: -len(ROTATED_SUFFIX)] if rotated else precision
    example = f"e.g. int4{ROTATED_SUFFIX} or int8{MIXED_SEP}int4{ROTATED_SUFFIX}"
    if rotated and base == FULL_PRECISION:
        raise ValueError(f"precision {precision!r}: {FULL_PRECISION} has no quantized tier to rotate; {example}")
    parts = base.split(MIXED_SEP)
    if any(x.endswith(ROTATED_SUFFIX) and x[:-1] in LOW_PRECISIONS for x in parts):
        raise ValueError(f"precision {precision!r}: one {ROTATED_SUFFIX!r} suffix, after the whole "
                         f"precision (it rotates every quantized tier of the row); {example}")
    if rotated and MIXED_SEP not in base and base not in (*LOW_PRECISIONS, PER_HEAD):
        raise ValueError(f"precision {precision!r}: {base!r} is not a low precision "
                         f"({list(LOW_PRECISIONS)}); {example}")
    if MIXED_SEP in base:
        mixed_formats(base)  # checks the pair
    return base, rotated
STOCK = "stock"  # kind of SGLang's own quantized KV caches; their Config.precision is the dtype
STOCK_PREFIX = "sglang-"  # "sglang-<--kv-cache-dtype>", e.g. sglang-nvfp4
STOCK_AUTO = "auto"  # stock SGLang's own cache in the model's dtype (served only)


def stock_configs(dtypes: Sequence[str], scorer: str, served: bool = False) -> list[Config]:
    """SGLang's own quantized KV caches, "sglang-<dtype>" per ``--kv-cache-dtype`` value
    (fp8_e4m3 mxfp8 fp4_mx_block16 nvfp4; emulator/sglang_caches.py): every token kept at the
    format's own bytes, which are the configuration's rho. bench.offline_loss emulates them;
    bench.accuracy (`served`) starts stock SGLang servers with them, and there also takes
    "auto" (sglang-auto: stock's cache in the model's dtype, whose distance from `full` is
    the two backends' own difference, not a cache's)."""
    if STOCK_AUTO in dtypes and not served:
        raise ValueError(f"--stock {STOCK_AUTO}: only a served stock cache (bench.accuracy) can "
                         "be the model's own dtype; the emulator's reference is already full")
    return [Config(f"{STOCK_PREFIX}{d}", STOCK, stock_bytes(d, 64), scorer, "uniform:1.0", d)
            for d in dtypes]


def stock_bytes(dtype: str, head_dim: int) -> float:
    """KV bytes per token of SGLang's `--kv-cache-dtype dtype` cache, as a fraction of bf16's
    (`auto`: the model's own dtype, 1)."""
    from sgl_ragged.emulator.sglang_caches import stock_format

    return 1.0 if dtype == STOCK_AUTO else stock_format(dtype).bytes_fraction(head_dim)


def mixed_formats(precision: str) -> tuple[Any, Any]:
    """The (hi, lo) LowPrecision formats of a pair "hi+lo" such as "int8+int4"."""
    from sgl_ragged.precision import LOW_PRECISIONS, low_precision

    parts = precision.split(MIXED_SEP)
    if len(parts) != 2 or not all(x in LOW_PRECISIONS for x in parts):
        raise ValueError(f"precision pair {precision!r}: expected <hi>{MIXED_SEP}<lo> with both in "
                         f"{list(LOW_PRECISIONS)}, e.g. int8{MIXED_SEP}int4")
    hi, lo = (low_precision(x) for x in parts)
    return hi, lo


def mixed_tiers(config: Config, shape: Any, page_size: int = PAGE_SIZE) -> tuple[list[list[Any]], float]:
    """A "h+l@rho" configuration's row tiers [L][G] (tiers.compose_mixed per group of its
    profile) and its KV bytes per token as a fraction of a full bf16 cache."""
    from sgl_ragged.mem_pool.tiers import compose_mixed, mixed_tier_bytes
    from sgl_ragged.profile import resolve_profile
    from sgl_ragged.scoring import SINK_TOKENS

    hi_fmt, lo_fmt = mixed_formats(split_rotated(config.precision)[0])
    profile = resolve_profile(config.profile, shape)
    budget_slots = profile.slots_per_group(page_size, min_slots=SINK_TOKENS)  # [L][G]
    tiers = [[compose_mixed(k, page_size, shape.head_dim, 2, hi_fmt, lo_fmt, SINK_TOKENS)
              for k in layer] for layer in budget_slots]
    kept = sum(mixed_tier_bytes(t, hi_fmt, lo_fmt, len(heads), shape.head_dim)
               for layer_groups, layer_tiers in zip(profile.groups, tiers, strict=True)
               for heads, t in zip(layer_groups, layer_tiers, strict=True))
    heads = sum(len(g) for g in profile.groups[0])
    full = 2 * len(profile.groups) * heads * page_size * shape.head_dim * 2
    return tiers, kept / full


PROFILE = "profile"  # kind of a configuration named on the command line: one profile file as is


def profile_config(spec: str, scorer: str, shape: Any, page_size: int = PAGE_SIZE) -> Config:
    """`NAME=PATH` or `NAME=PATH=PRECISION` (--profile-config) -> a configuration serving that
    profile file as is (its compositions where it has them: a `sgl-ragged profile tiers`
    output, e.g. per-head precision), at PRECISION (default: the profile's own compositions'
    precision, with the rotated suffix where they were searched rotated, else bf16). Its rho is
    its KV bytes per token (fraction of bf16), to 3 places."""
    from sgl_ragged.profile import resolve_profile

    parts = spec.split("=")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"--profile-config {spec!r}: expected NAME=PATH or NAME=PATH=PRECISION, "
                         "e.g. perhead@0.2=calib_profiles/smollm2-135m-instruct/perhead-rho0.2.json")
    name, path = parts[:2]
    if not Path(path).is_file():
        raise ValueError(f"--profile-config {spec!r}: no profile file at {path}")
    profile = resolve_profile(path, shape)
    tiers = profile.tiers
    own = "bf16" if tiers is None else tiers.precision + (ROTATED_SUFFIX if tiers.rotated else "")
    precision = parts[2] if len(parts) == 3 else own
    if tiers is not None and tiers.rotated and precision == tiers.precision:
        raise ValueError(f"--profile-config {spec!r}: {path} was searched for rows stored rotated "
                         f"(tiers.rotation {tiers.rotation}); name its precision {own} (or leave "
                         "it out)")
    config = Config(name, PROFILE, 0.0, scorer, path, precision)
    return Config(name, PROFILE, round(config_bytes(config, shape, page_size), 3), scorer, path,
                  precision)


def config_bytes(config: Config, shape: Any, page_size: int = PAGE_SIZE) -> float:
    """KV bytes per logical token of a configuration, as a fraction of a full bf16 cache (the
    dynamic reference counts the entries it keeps, rho; its pages stay full-size)."""
    from sgl_ragged.mem_pool.layout import RaggedLayout
    from sgl_ragged.profile import resolve_profile

    if config.is_dynamic:
        return config.rho
    if config.kind == STOCK:
        return stock_bytes(config.precision, shape.head_dim)
    if MIXED_SEP in config.precision and config.kind != PROFILE:
        return mixed_tiers(config, shape, page_size)[1]
    profile = resolve_profile(config.profile, shape)
    base = split_rotated(config.precision)[0]  # a rotation costs no bytes
    return RaggedLayout.from_profile(profile, page_size, shape.head_dim, 2, base).retention


def other_sources() -> list[str]:
    """The budget sources besides TANGRAM's (whose profiles are the static configurations);
    a configuration of one has the source's name as its kind."""
    from sgl_ragged.sources import DEFAULT_SOURCE, SOURCES

    return [name for name in SOURCES if name != DEFAULT_SOURCE]


def equal_memory_file(source: str, scorer: str, rho: float) -> str:
    """The file name of a source's equal-memory profile: <prefix><scorer>-[mean-]rho<rho>.json,
    in budget mode mean (mean budget = rho) where the source has a margin
    (kvcompose-<s>-mean-rho<r>.json, baklava-<s>-rho<r>.json)."""
    from sgl_ragged.sources import make_source

    budget_source = make_source(source)
    mean = "mean-" if budget_source.margin else ""
    return f"{budget_source.output_prefix}{scorer}-{mean}rho{rho}.json"


def plan_configs(rhos: list[float], scorers: list[str], profile_dir: Path, head_dim: int,
                 precisions: Sequence[str] = (), page_size: int = PAGE_SIZE) -> tuple[list[Config], list[str]]:
    """full, then per rho (smallest first): uniform, and per scorer static (margin budgets),
    static-mean (mean budget = rho, where that profile exists), the other equal-memory budget
    sources where their profiles exist (kvcompose: kvcompose-<s>-mean-rho<r>.json, baklava:
    baklava-<s>-rho<r>.json) and dynamic; then the row tiers of ``precisions`` (sized for the
    model's ``head_dim``, model_shape(model).head_dim). Returns the configurations and the margin profile
    files that do not exist (skipped)."""
    configs, missing = [Config(FULL, FULL, 1.0, scorers[0], "uniform:1.0")], []
    for rho in sorted(r for r in rhos if r < 1.0):
        configs.append(Config(f"uniform@{rho}", "uniform", rho, scorers[0], f"uniform:{rho}"))
        for s in scorers:
            path = profile_dir / f"{s}-rho{rho}.json"
            if path.is_file():
                configs.append(Config(f"static-{s}@{rho}", "static", rho, s, str(path)))
            else:
                missing.append(str(path))
            mean_path = profile_dir / f"{s}-mean-rho{rho}.json"
            if mean_path.is_file():
                configs.append(Config(f"static-mean-{s}@{rho}", "static-mean", rho, s, str(mean_path)))
            for source in other_sources():
                file = equal_memory_file(source, s, rho)
                if (profile_dir / file).is_file():
                    configs.append(Config(f"{source}-{s}@{rho}", source, rho, s, str(profile_dir / file)))
            configs.append(Config(f"dynamic-{s}@{rho}", "dynamic", rho, s, f"dynamic:{rho}"))
    per_head = [p for p in precisions if split_rotated(p)[0] == PER_HEAD]  # mixed, mixedr
    precisions = [p for p in precisions if p not in per_head]
    for p in per_head:  # the shipped per-head precision profiles (calibrate/precision_search.py)
        for rho in sorted(rhos):
            path = profile_dir / f"{PER_HEAD}-uniform-rho{rho:g}.json"
            if path.is_file():
                configs.append(Config(f"{p}@{rho}", "tiers-per-head", rho, scorers[0], str(path), p))
            elif str(path) not in missing:
                missing.append(str(path))
    return configs + precision_configs(rhos, list(precisions), scorers[0], head_dim, page_size), missing
