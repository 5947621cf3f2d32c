"""Per-process state of the ragged backend: its settings and, once the model is known, its layout.

SGLang builds pools, allocator and attention backend in the scheduler process through
separate factories; they meet here instead of through attributes stashed on SGLang objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import BudgetProfile


@dataclass
class RaggedRuntime:
    config: RaggedConfig
    layout: RaggedLayout | None = None
    profile: BudgetProfile | None = None  # the resolved profile the layout was built from
    num_staging_pages: int = 0
    # Every tensor-parallel rank's layout (rank order); capacity is the smallest (tp.py).
    rank_layouts: tuple[RaggedLayout, ...] = ()
    attention_scale: float | None = None  # the model's softmax scale, from its config

    @property
    def dynamic_rho(self) -> float | None:
        """rho of the dynamic reference mode (profile dynamic:<rho>), else None."""
        if self.profile is None or not self.profile.source.is_dynamic:
            return None
        return self.profile.source.rho

    def require_layout(self) -> RaggedLayout:
        if self.layout is None:
            raise RuntimeError(
                "the ragged layout is not resolved yet: the KV pool was built before SGLang "
                "sized it (is another plugin replacing DefaultPoolConfigurator?)"
            )
        return self.layout


_runtime: RaggedRuntime | None = None


def get_runtime() -> RaggedRuntime:
    """The ragged runtime of this process, read from the environment on first use."""
    global _runtime
    if _runtime is None:
        _runtime = RaggedRuntime(config=RaggedConfig.from_env())
    return _runtime


def reset_runtime() -> None:
    """Forget the process state (tests build several layouts in one process)."""
    global _runtime
    _runtime = None
