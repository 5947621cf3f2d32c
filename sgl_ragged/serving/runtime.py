"""The scheduler process's ragged setup: resolved once per model, read by the pool and backend.

SGLang builds the pool configurator, the KV pool, the allocator and the attention backend of a
scheduler process through separate factories with fixed signatures, so what the first one
resolves cannot reach the others as an argument. That hand-off is one frozen `ServingSetup`:
`build_setup` (a pure function of the settings and the model) makes it in the capacity hook
(scheduler_hooks.compute_cell_size, which SGLang calls once per configurator, where the model
config, the page size and the layer count first meet), `publish_setup` stores it, and the pool
(serving/pool.py) and the backend (serving/backend.py) read it with `current_setup()`. Nothing
else is process-global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import BudgetProfile, ModelShape
from sgl_ragged.rotation import HeadRotations, Rotation
from sgl_ragged.tp import agreed_cell_size, agreed_logical_pages, rank_heads, resolve_rank_profiles


@dataclass(frozen=True)
class ServingSetup:
    """What the scheduler process serves with: settings, this rank's profile and every rank's
    layout, the staging pool's size and the model's softmax scale."""

    config: RaggedConfig
    profile: BudgetProfile  # this rank's slice of the resolved profile (its AOT split ratios)
    rank_layouts: tuple[RaggedLayout, ...]  # every tensor-parallel rank's layout, rank order
    tp_rank: int
    num_staging_pages: int
    attention_scale: float  # the model's softmax scale, from its config
    start_layer: int = 0  # the model's layer that is this pipeline stage's local layer 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < len(self.rank_layouts):
            raise ValueError(f"tp_rank {self.tp_rank} outside the {len(self.rank_layouts)} "
                             "rank layouts")

    @property
    def layout(self) -> RaggedLayout:
        """This rank's layout."""
        return self.rank_layouts[self.tp_rank]

    def rotations(self, device: Any) -> HeadRotations | None:
        """The rows' rotations of this rank (--ragged-rotation hadamard; None: none): its
        pipeline stage's layers and its KV heads, by their indices in the whole model."""
        if not self.config.rotated:
            return None
        layout, tp_size = self.layout, len(self.rank_layouts)
        return HeadRotations(Rotation(layout.head_dim),
                             range(self.start_layer, self.start_layer + layout.num_layers),
                             rank_heads(layout.num_kv_heads * tp_size, tp_size, self.tp_rank), device)

    @property
    def dynamic_rho(self) -> float | None:
        """rho of the dynamic reference mode (profile dynamic:<rho>), else None."""
        return self.profile.source.rho if self.profile.source.is_dynamic else None

    def cell_size(self) -> int:
        """Bytes per logical token SGLang sizes the pool with (the widest rank's, tp.py)."""
        return agreed_cell_size(self.rank_layouts)

    def logical_pages(self, available_bytes: int) -> int:
        """Logical pages every rank admits in available_bytes, after the staging pool."""
        return agreed_logical_pages(self.rank_layouts, available_bytes, self.num_staging_pages)


def build_setup(config: RaggedConfig, shape: ModelShape, *, page_size: int, dtype_bytes: int,
                max_running_requests: int, tp_size: int, tp_rank: int,
                attention_scale: float, layers: tuple[int, int] | None = None) -> ServingSetup:
    """Resolve the profile for the whole model (``shape``), cut it to this pipeline stage's
    layers ``[start, end)`` where given (pp.py), slice it per rank (tp.py) and lay out every
    rank's storage; the staging pool holds W + 1 pages per running request plus one spare
    request's worth (the scratch page comes out of it)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside the {tp_size} tensor-parallel ranks")
    if config.rotated and (shape.head_dim < 1 or shape.head_dim & (shape.head_dim - 1)):
        raise ValueError(
            f"--ragged-rotation {config.rotation} rotates each head by a Hadamard matrix, which "
            f"needs a power-of-two head_dim; this model's is {shape.head_dim}: pass "
            "--ragged-rotation none")
    profiles = resolve_rank_profiles(config.profile, shape, config.heads_per_group, tp_size, layers)
    layouts = tuple(RaggedLayout.from_profile(p, page_size, shape.head_dim, dtype_bytes,
                                              precision=config.precision) for p in profiles)
    return ServingSetup(
        config=config,
        profile=profiles[tp_rank],
        rank_layouts=layouts,
        tp_rank=tp_rank,
        num_staging_pages=(max_running_requests + 1) * (config.window_pages + 1),
        attention_scale=attention_scale,
        start_layer=0 if layers is None else layers[0],
    )


def attention_scale(hf_config: Any, head_dim: int) -> float:
    """The model's attention softmax scale from its config: 1/sqrt(query_pre_attn_scalar) where
    the config has one (Gemma 2/3), else 1/sqrt(head_dim) (Llama, Qwen, SmolLM2, ...)."""
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    return float(scalar if scalar else head_dim) ** -0.5


_published: ServingSetup | None = None


def publish_setup(setup: ServingSetup) -> bool:
    """Make `setup` the one the pool and backend read; True if it differs from the last one
    (SGLang may build the configurator twice with the same configuration)."""
    global _published
    changed = setup != _published
    _published = setup
    return changed


def current_setup() -> ServingSetup:
    """The published setup; a clear error if SGLang built the pool before sizing it."""
    if _published is None:
        raise RuntimeError(
            "the ragged setup is not resolved yet: the KV pool or attention backend was built "
            "before SGLang sized the pool (is another plugin replacing DefaultPoolConfigurator?)"
        )
    return _published


def clear_setup() -> None:
    """Forget the published setup (tests build several in one process)."""
    global _published
    _published = None


def pipeline_stage(layer_info: Any, num_layers: int, model_layers: int) -> tuple[int, int] | None:
    """This pipeline stage's layers [start, end) of the model's ``model_layers`` from SGLang's
    ModelLayerInfo (None: the stage holds them all, as without --pp-size); a clear error where
    its KV layer count is not that range (a layout the ragged pool does not know)."""
    start, end = int(layer_info.start_layer), int(layer_info.end_layer)
    if end - start != num_layers:
        raise ValueError(
            f"SGLang sizes the KV pool for {num_layers} layers, but this scheduler holds layers "
            f"[{start}, {end}) of the model: the ragged backend stores one KV layer per model "
            "layer (no looped or hybrid layer layouts)"
        )
    return None if (start, end) == (0, model_layers) else (start, end)


def tensor_parallel_rank() -> tuple[int, int]:
    """(tp_size, tp_rank) of this scheduler process; (1, 0) before SGLang's groups exist."""
    from sglang.srt.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())
