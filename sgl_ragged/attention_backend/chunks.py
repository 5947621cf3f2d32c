"""Prefill chunk boundaries, handed from the scheduler to the next forward's planning."""

from __future__ import annotations

from collections.abc import Sequence


class PrefillChunks:
    """Which requests' next extend is their last prefill chunk (docs/architecture.md, "One forward pass": a chunk
    that is not the last seals all its complete pages, the last one keeps the window).

    The scheduler hook after `prepare_for_extend` (serving/scheduler_hooks.py) records each
    request of the batch; the serving backend takes the records of the batch it plans and
    passes them to the core's planning. SGLang hands the two no common argument, so the
    serving KV pool owns it (the hook reaches it through the batch's allocator, the backend
    through the model runner's pool). Requests without a record (decode) count as final.
    """

    def __init__(self) -> None:
        self._final: dict[int, bool] = {}  # req pool index -> its next extend is the last chunk

    def record(self, req_pool_idx: int, final: bool) -> None:
        self._final[req_pool_idx] = final

    def take(self, req_pool_indices: Sequence[int]) -> list[bool]:
        """Per request, whether this forward's extend is its last chunk; forgets the records."""
        return [self._final.pop(r, True) for r in req_pool_indices]
