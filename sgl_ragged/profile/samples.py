"""The per-sample retention a calibrated profile records (``stats["samples"]``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_ragged.profile.validation import ProfileError, check_shape, float_matrix, is_sequence

# Schema of the calibrator's entries in the open ``stats`` object (version 1 files carry any
# JSON there; these keys are checked on load when present). stats["samples"] holds the
# per-sample retention the budgets were derived from: {"tasks": [S], "tokens": [S],
# "retention": [S][L][H]}.
STATS_SCHEMA = 1


@dataclass(frozen=True)
class SampleRetention:
    """Per-sample retention recorded by calibration (``stats["samples"]``)."""

    tasks: tuple[str, ...]  # [S] task type of each sample
    tokens: tuple[int, ...]  # [S] sample length in tokens
    retention: tuple[tuple[tuple[float, ...], ...], ...]  # [S][L][H] kept / offered

    @classmethod
    def from_stats(cls, data: Any, num_layers: int, num_heads: int) -> SampleRetention:
        """Parse and check ``stats["samples"]`` against the profile's [L][H] shape."""
        if not isinstance(data, dict) or sorted(data) != ["retention", "tasks", "tokens"]:
            raise ProfileError(
                "stats.samples must be an object with exactly the keys "
                f"['retention', 'tasks', 'tokens'], got {data!r:.80}"
            )
        tasks, tokens, retention = data["tasks"], data["tokens"], data["retention"]
        if not is_sequence(retention) or not retention:
            raise ProfileError("stats.samples.retention must be a non-empty list [S][L][H]")
        count = len(retention)
        if not (is_sequence(tasks) and len(tasks) == count and all(isinstance(t, str) for t in tasks)):
            raise ProfileError(f"stats.samples.tasks must be {count} strings, one per sample")
        if not (is_sequence(tokens) and len(tokens) == count
                and all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tokens)):  # fmt: skip
            raise ProfileError(f"stats.samples.tokens must be {count} positive ints, one per sample")
        matrices = []
        for i, sample in enumerate(retention):
            name = f"stats.samples.retention[{i}]"
            matrix = float_matrix(name, sample)
            check_shape(name, matrix, num_layers, num_heads)
            if any(not 0.0 <= x <= 1.0 for row in matrix for x in row):
                raise ProfileError(f"{name} has a retention outside [0, 1]")
            matrices.append(matrix)
        return cls(tuple(tasks), tuple(tokens), tuple(matrices))
