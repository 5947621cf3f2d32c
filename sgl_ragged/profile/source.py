"""The ``source`` record of a budget profile: which source made its budgets, with what settings.

On disk it is the profile's ``"source"`` object: ``{"kind": ..., <parameters>...}``. Kinds are
the model-free ones below (``uniform``, ``dynamic``: the ``<kind>:<ratio>`` specs of spec.py, no
calibration) and those a calibrating ``BudgetSource`` writes (the registry in sgl_ragged/sources
says which source wrote a record: ``source_of``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from sgl_ragged.profile.validation import ProfileError


class ModelFreeKind(str, Enum):
    """Sources whose profiles fit any model (no calibration, no recorded model)."""

    UNIFORM = "uniform"  # B = ratio for every head
    DYNAMIC = "dynamic"  # the dynamic reference mode: full pages, Eq. 3 at rho when sealing


MODEL_FREE_KINDS = frozenset(kind.value for kind in ModelFreeKind)


@dataclass(frozen=True, eq=False)
class SourceRecord(Mapping[str, Any]):
    """A profile's ``source``: its ``kind`` and the parameters that made the budgets.

    ``params`` keeps every other key of the JSON object in file order (scorer, rho, alpha,
    samples, corpus, ... as the source wrote them), so files round-trip unchanged. The record
    reads as that JSON object (``record["rho"]``, ``record.get("alpha")``, equality with a
    dict); typed views of the common fields are properties.
    """

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ProfileError(f"a source record needs a non-empty string kind, got {self.kind!r}")
        if "kind" in self.params:
            raise ProfileError("a source record's params must not repeat its kind")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @classmethod
    def model_free(cls, kind: ModelFreeKind, rho: float) -> SourceRecord:
        """The record of a ``uniform:<ratio>`` or ``dynamic:<rho>`` profile."""
        return cls(kind.value, {"rho": float(rho)})

    # ----- typed views ---------------------------------------------------------------

    @property
    def rho(self) -> float | None:
        """The target retention the budgets were made for, if recorded."""
        rho = self.params.get("rho")
        return None if rho is None else float(rho)

    @property
    def scorer(self) -> str | None:
        """The scorer the budgets were calibrated with, if any."""
        return self.params.get("scorer")

    @property
    def fits_any_model(self) -> bool:
        """Whether the profile may omit its model (a model-free kind)."""
        return self.kind in MODEL_FREE_KINDS

    @property
    def is_dynamic(self) -> bool:
        """Whether this is the dynamic reference mode (per-input selection at rho)."""
        return self.kind == ModelFreeKind.DYNAMIC.value

    # ----- derivation and JSON -------------------------------------------------------

    def updated(self, changes: Mapping[str, Any]) -> SourceRecord:
        """The record with ``changes`` applied: existing keys keep their place, new ones follow."""
        return SourceRecord(self.kind, {**self.params, **changes})

    def to_json(self) -> dict[str, Any]:
        """The profile file's ``source`` object."""
        return {"kind": self.kind, **self.params}

    @classmethod
    def from_json(cls, data: Any) -> SourceRecord:
        """Inverse of ``to_json``; ProfileError unless ``data`` is an object with a string kind."""
        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str):
            raise ProfileError(f"source must be an object with a string 'kind' (e.g. 'calibrated'), "
                             f"got {data!r}")
        return cls(data["kind"], {k: v for k, v in data.items() if k != "kind"})

    @classmethod
    def of(cls, value: SourceRecord | Mapping[str, Any]) -> SourceRecord:
        """``value`` itself if it is a record, else the record of that JSON object."""
        return value if isinstance(value, SourceRecord) else cls.from_json(value)

    # ----- the JSON object's read-only mapping view ----------------------------------

    def __getitem__(self, key: str) -> Any:
        return self.kind if key == "kind" else self.params[key]

    def __iter__(self) -> Iterator[str]:
        yield "kind"
        yield from self.params

    def __len__(self) -> int:
        return 1 + len(self.params)
