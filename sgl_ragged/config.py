"""Server-side settings of the ragged backend: command-line flags <-> environment variables.

SGLang's ServerArgs is a closed struct and the scheduler runs in a spawned process, so our
flags travel as environment variables (each flag also has its environment form, for
`sglang serve`, the Engine API and tests).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from sgl_ragged.precision import (
    FULL_PRECISION,
    HIGH_CHOICES,
    PRECISION_CHOICES,
    TIER_SEP,
    tier_precision,
)
from sgl_ragged.profile import ProfileTiers, profile_tiers
from sgl_ragged.rotation import ROTATIONS
from sgl_ragged.scoring import SCORERS

# Model families whose SGLang models call RadixAttention for plain causal attention (a
# checkpoint's own layers are checked again at startup: serving/backend.check_attention_layers);
# each is served against transformers in tests/e2e/test_architectures.py.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GemmaForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "StableLmForCausalLM",
    "Starcoder2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "OlmoeForCausalLM",
    "Glm4ForCausalLM",
    "CohereForCausalLM",
    "PhiForCausalLM",
    "OlmoForCausalLM",
    "GraniteMoeForCausalLM",
    "ArceeForCausalLM",
    "Glm4MoeForCausalLM",
    "OPTForCausalLM",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
)
# Sequence classifiers and reward models of those families: their decoder under a score head
# on the last token, served as SGLang serves them (an embedding model: /v1/embeddings returns
# the scores); tests/e2e/test_classifiers.py holds them to transformers. The offline tools
# calibrate their retention (TANGRAM, KVCompose); the loss-based searches need an LM head.
# (Not Qwen2's or Qwen3's: SGLang 0.5.23 gives their score heads a bias that transformers'
# checkpoints do not carry and leaves it uninitialized, so stock backends score them wrong too.)
SEQUENCE_CLASSIFIERS = ("LlamaForSequenceClassification",)
SERVED_ARCHITECTURES = SUPPORTED_ARCHITECTURES + SEQUENCE_CLASSIFIERS
DEFAULT_PAGE_SIZE = 64
DEFAULT_MAX_RUNNING_REQUESTS = 32
ATTENTION_IMPLS = ("auto", "triton", "native", "batched", "reference")
AUTO_PRECISION = "auto"
"""--ragged-precision's default: what the profile file was written for (`profile_tiers`:
`mixed` for per-head formats, the precision `sgl-ragged profile tiers` searched), else bf16."""
AUTO_ROTATION = "auto"
"""--ragged-rotation's default: what the profile file's tiers were searched for
(`profile_tiers`) where they are served at their precision, else none."""


@dataclass(frozen=True)
class Flag:
    """One `--ragged-*` flag and its environment variable."""

    name: str
    env: str
    default: str | None
    help: str


FLAGS = (
    Flag("profile", "RAGGED_PROFILE", None,
         "Budget profile: a profile JSON file (python -m sgl_ragged.calibrate) or "
         "'uniform:<ratio>', e.g. uniform:0.3 keeps 30%% of every KV head."),
    Flag("scorer", "RAGGED_SCORER", "snapkv",
         f"Token scorer used when sealing pages: one of {', '.join(sorted(SCORERS))}."),
    Flag("window-pages", "RAGGED_WINDOW_PAGES", "1",
         "Complete pages each running request keeps uncompressed (recent window)."),
    Flag("heads-per-group", "RAGGED_HEADS_PER_GROUP", None,
         "KV heads per head group H_p (default: the profile's grouping)."),
    Flag("obs-window", "RAGGED_OBS_WINDOW", "32",
         "Observation window: the last N queries of a prefill chunk score its tokens."),
    Flag("attention", "RAGGED_ATTENTION", "auto",
         "Attention implementation: auto (Triton kernels on CUDA; on the CPU the native C++ "
         "kernels where built (python -m sgl_ragged.native build), else batched torch), "
         "triton, native, batched, or reference (the per-request torch oracle)."),
    Flag("precision", "RAGGED_PRECISION", AUTO_PRECISION,
         "How rows spend their bytes: auto (default: what the profile file was written for, "
         "mixed for a per-head profile, the precision a `profile tiers` file was searched for, "
         "else bf16), bf16 (the model dtype; budgets drop tokens) or a low "
         f"precision ({', '.join(PRECISION_CHOICES[1:])}) that keeps more tokens per byte: the "
         "page's best tokens at the model dtype, the next ones quantized, the rest dropped; or "
         f"a pair H{TIER_SEP}L (H one of {', '.join(HIGH_CHOICES[1:])}, e.g. int8{TIER_SEP}int4) that "
         "quantizes the best tokens too, in H; or mixed: each head group's format and composition "
         "from the profile (`sgl-ragged profile tiers --precision mixed`). Every attention path "
         "reads all of them."),
    Flag("rotation", "RAGGED_ROTATION", AUTO_ROTATION,
         "auto (default: what the profile file's tiers were searched for when served at their "
         "precision, else none), none, or hadamard: store every row of a KV head rotated by a "
         "fixed randomized Hadamard matrix (queries rotated alike, outputs rotated back: the "
         "same attention), so that quantized tiers see no outlier channels; needs a low "
         "precision, a power-of-two head_dim and a scorer that reads dot products and norms "
         "(not expected_attention)."),
    Flag("check-integrity", "RAGGED_CHECK_INTEGRITY", "0",
         "1 = run the pool's integrity check after every forward pass (debugging, tests)."),
    Flag("hold-history", "RAGGED_HOLD_HISTORY", "auto",
         "Seconds to keep a finished request's conversation in the radix cache for its next "
         "turn, while finished conversations come back (a third of the latest within that "
         "time): admission neither evicts it nor counts it as room meanwhile. auto (default): "
         "2 with the ragged backend (off with --tp-size or --pp-size above 1), off for other "
         "backends; 0 = off; any backend takes seconds (serving/history_holds.py)."),
    Flag("hold-limit", "RAGGED_HOLD_LIMIT", "120",
         "Seconds a conversation stays held turn after turn while a request that continues no "
         "held conversation has waited longer than the hold time: past them its next finished "
         "turn is not held again, so a new session waits at most about this long plus a turn "
         "for the pages of sessions that keep coming back. 0 = no limit."),
)


@dataclass(frozen=True)
class RaggedConfig:
    """Settings of the ragged backend, as they reach the scheduler process."""

    profile: str
    scorer: str = "snapkv"
    window_pages: int = 1
    heads_per_group: int | None = None
    obs_window: int = 32
    attention: str = "auto"
    precision: str = AUTO_PRECISION  # resolved in __post_init__: never "auto" after it
    check_integrity: bool = False
    rotation: str = AUTO_ROTATION  # resolved in __post_init__: one of rotation.ROTATIONS after it

    def __post_init__(self) -> None:
        if not self.profile:
            raise ValueError(
                "--attention-backend ragged needs a budget profile: pass --ragged-profile "
                "uniform:0.3 (or a profile file from python -m sgl_ragged.calibrate)"
            )
        if self.scorer not in SCORERS:
            raise ValueError(
                f"--ragged-scorer {self.scorer!r} is unknown; choose one of {sorted(SCORERS)}"
            )
        if self.window_pages < 0:
            raise ValueError(f"--ragged-window-pages must be >= 0, got {self.window_pages}")
        if self.obs_window < 1:
            raise ValueError(f"--ragged-obs-window must be >= 1, got {self.obs_window}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(
                f"--ragged-attention {self.attention!r} is unknown; choose one of {ATTENTION_IMPLS}"
            )
        tiers = profile_tiers(self.profile)  # the file read once, for both defaults
        if self.precision.strip().lower() == AUTO_PRECISION:
            object.__setattr__(self, "precision", FULL_PRECISION if tiers is None else tiers.precision)
        # raises for an unknown precision; bf16+L is named L
        object.__setattr__(self, "precision", tier_precision(self.precision).name)
        if self.precision != FULL_PRECISION and self.profile.strip().lower().startswith("dynamic:"):
            raise ValueError(
                f"--ragged-precision {self.precision} cannot be combined with the dynamic "
                "reference mode (--ragged-profile dynamic:<rho> keeps full-size, full-precision "
                "rows and masks dropped tokens); use --ragged-precision bf16 or a static profile"
            )
        if self.heads_per_group is not None and self.heads_per_group < 1:
            raise ValueError(f"--ragged-heads-per-group must be >= 1, got {self.heads_per_group}")
        self._check_rotation(tiers)

    @property
    def rotated(self) -> bool:
        return self.rotation != ROTATIONS[0]

    def _check_rotation(self, tiers: ProfileTiers | None) -> None:
        if self.rotation not in (AUTO_ROTATION, *ROTATIONS):
            raise ValueError(f"--ragged-rotation {self.rotation!r} is unknown; choose one of "
                             f"{[AUTO_ROTATION, *ROTATIONS]}")
        # a profile's tiers searched on rotated rows, served at their precision: rotated rows
        searched = tiers.rotation if tiers is not None and tiers.precision == self.precision else None
        if self.rotation == AUTO_ROTATION:
            object.__setattr__(self, "rotation", searched or ROTATIONS[0])
        elif searched not in (None, ROTATIONS[0]) and self.rotation != searched:
            raise ValueError(
                f"--ragged-rotation {self.rotation}: the profile {self.profile} was searched for "
                f"rows stored with --ragged-rotation {searched} (its tiers.rotation): its "
                f"{self.precision} compositions and formats were chosen for rotated rows; pass "
                f"--ragged-rotation {searched} (or auto), or a profile searched without one")
        if not self.rotated:
            return
        if self.precision == FULL_PRECISION:
            raise ValueError(
                f"--ragged-rotation {self.rotation} rotates rows so that their quantized tiers "
                f"lose less, but --ragged-precision {FULL_PRECISION} keeps none; pass a low "
                "precision (e.g. --ragged-precision int4, or mixed with a per-head profile) or "
                "--ragged-rotation none")
        if not SCORERS[self.scorer].rotation_invariant:
            raise ValueError(
                f"--ragged-rotation {self.rotation} stores rotated keys, and --ragged-scorer "
                f"{self.scorer} scores them by per-channel statistics, which a rotation changes "
                "(its pages would keep other tokens than calibrated); use a scorer of dot "
                f"products and norms ({', '.join(sorted(n for n, c in SCORERS.items() if c.rotation_invariant))}) "
                "or --ragged-rotation none")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RaggedConfig:
        env = os.environ if environ is None else environ

        def get(flag_name: str) -> str | None:
            flag = next(f for f in FLAGS if f.name == flag_name)
            return env.get(flag.env) or flag.default

        hpg = get("heads-per-group")
        return cls(
            profile=get("profile") or "",
            scorer=get("scorer") or "snapkv",
            window_pages=_parse_int("--ragged-window-pages", get("window-pages")),
            heads_per_group=None if hpg is None else _parse_int("--ragged-heads-per-group", hpg),
            obs_window=_parse_int("--ragged-obs-window", get("obs-window")),
            attention=get("attention") or "auto",
            precision=(get("precision") or AUTO_PRECISION).strip().lower(),
            check_integrity=(get("check-integrity") or "0").lower() in ("1", "true", "yes"),
            rotation=(get("rotation") or AUTO_ROTATION).strip().lower(),
        )


def _parse_int(flag: str, value: str | None) -> int:
    try:
        return int(value or "")
    except ValueError:
        raise ValueError(f"{flag} expects an integer, got {value!r}") from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the `--ragged-*` flags to an SGLang argument parser."""
    group = parser.add_argument_group("ragged KV cache (sgl-ragged)")
    for flag in FLAGS:
        group.add_argument(f"--ragged-{flag.name}", type=str, default=None,
                           help=f"{flag.help} [env {flag.env}]")


_SET_FROM_KEYWORDS: dict[str, str | None] = {}  # env var -> its value before the keywords


def move_keyword_args_to_env(kwargs: dict[str, object]) -> None:
    """Pop our flags off `sglang.Engine(**kwargs)` (`ragged_profile="uniform:0.3"`, ...) into
    the environment, as `move_cli_args_to_env` does for the command line. What an earlier
    Engine of this process set this way is undone first, so each Engine gets its own keywords
    (and the environment's own RAGGED_* values where it passes none). True / False are 1 / 0."""
    for env, before in _SET_FROM_KEYWORDS.items():
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
    _SET_FROM_KEYWORDS.clear()
    for flag in FLAGS:
        value = kwargs.pop("ragged_" + flag.name.replace("-", "_"), None)
        if value is not None:
            _SET_FROM_KEYWORDS[flag.env] = os.environ.get(flag.env)
            os.environ[flag.env] = str(int(value)) if isinstance(value, bool) else str(value)


def move_cli_args_to_env(args: argparse.Namespace) -> None:
    """Pop our flags off the namespace (ServerArgs has no such fields) into the environment,
    which the spawned scheduler and detokenizer processes inherit."""
    for flag in FLAGS:
        attr = "ragged_" + flag.name.replace("-", "_")
        value = getattr(args, attr, None)
        if hasattr(args, attr):
            delattr(args, attr)
        if value is not None:
            os.environ[flag.env] = value


