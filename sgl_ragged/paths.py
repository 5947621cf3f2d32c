"""Where the project keeps what it builds outside the checkout (a leaf: no project imports)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$RAGGED_CACHE`` or ``~/.cache/sgl-ragged``: the native builds, the materialized default
    model, the benchmarks' baseline builds."""
    return Path(os.environ.get("RAGGED_CACHE", Path.home() / ".cache" / "sgl-ragged"))
