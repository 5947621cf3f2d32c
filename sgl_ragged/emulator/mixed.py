"""Row tiers with both tiers quantized (e.g. int8 over int4): the composition and bytes now live
in mem_pool/tiers.py (the server stores such rows too, `--ragged-precision H+L`); re-exported
here for the emulator's callers (compressed.py ``TierSelection.hi_fmt``, bench.offline_loss).
"""

from __future__ import annotations

from sgl_ragged.mem_pool.tiers import compose_mixed, mixed_tier_bytes

__all__ = ["compose_mixed", "mixed_tier_bytes"]
