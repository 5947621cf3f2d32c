"""``python -m sgl_ragged.models``: same as ``python -m sgl_ragged.models.smollm2``."""

from __future__ import annotations

from sgl_ragged.models.smollm2 import main

main()
