"""The checks a budget profile passes on load: shapes, ranges, head groups, the file header.

Every failure is a ``ProfileError`` whose message names the field and says how to fix it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import sgl_ragged.budgets as budget_math

PROFILE_FORMAT = "sgl-ragged-profile"
PROFILE_VERSION = 4  # 2: optional "tiers" (row compositions for a low precision); 3: tiers.formats;
# 4: tiers.rotation (tiers searched for rotated rows: an older sgl-ragged must refuse the file
# rather than serve it unrotated)
READABLE_VERSIONS = (1, 2, 3, 4)
TIERS_VERSION = 2  # what a profile without per-head formats is written as (byte-identical re-saves)
PER_HEAD_VERSION = 3  # what a profile with per-head formats and unrotated rows is written as

Matrix = tuple[tuple[float, ...], ...]


class ProfileError(ValueError):
    """A budget profile is malformed or does not fit the model; the message says how to fix it."""


def as_lists(value: Any) -> Any:
    """Nested tuples as nested lists (JSON arrays)."""
    if isinstance(value, tuple | list):
        return [as_lists(v) for v in value]
    return value


def is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def float_matrix(name: str, value: Any) -> Matrix:
    """``value`` as a tuple of tuples of finite floats (rows may differ in length)."""
    if not is_sequence(value) or not all(is_sequence(row) for row in value):
        raise ProfileError(f"{name} must be a list of lists of numbers, got {value!r:.80}")
    for li, row in enumerate(value):
        for h, x in enumerate(row):
            if not is_number(x) or not math.isfinite(x):
                raise ProfileError(f"{name}[{li}][{h}] = {x!r} is not a finite number")
    return tuple(tuple(float(x) for x in row) for row in value)


def check_shape(name: str, matrix: Sequence[Sequence[Any]], rows: int, cols: int) -> None:
    if len(matrix) != rows:
        raise ProfileError(f"{name} has {len(matrix)} layers, expected {rows}")
    for li, row in enumerate(matrix):
        if len(row) != cols:
            raise ProfileError(f"{name}[{li}] has {len(row)} entries, expected {cols}")


def check_budget_range(budgets: Matrix) -> None:
    for li, row in enumerate(budgets):
        if not row:
            raise ProfileError(f"budgets[{li}] is empty; every layer needs one budget per KV head")
        for h, b in enumerate(row):
            if not 0.0 < b <= 1.0:
                raise ProfileError(
                    f"budgets[{li}][{h}] = {b} is outside (0, 1]; a budget is the fraction of "
                    f"tokens a head keeps"
                )


def stat_matrix(name: str, value: Any, num_layers: int, num_heads: int) -> Matrix | None:
    """``mu`` ([L][H] in [0, 1]) or ``sigma`` ([L][H] >= 0), or None."""
    if value is None:
        return None
    matrix = float_matrix(name, value)
    check_shape(name, matrix, num_layers, num_heads)
    low, high = (0.0, 1.0) if name == "mu" else (0.0, math.inf)
    for li, row in enumerate(matrix):
        for h, x in enumerate(row):
            if not low <= x <= high:
                raise ProfileError(f"{name}[{li}][{h}] = {x} is outside [{low}, {high}]")
    return matrix


def checked_split_ratios(value: Any, budgets: Matrix, groups: Any, num_groups: int) -> Matrix | None:
    """[L][G] split ratios that must match the budgets and groups (Algorithm 1), or None."""
    if value is None:
        return None
    ratios = float_matrix("split_ratios", value)
    check_shape("split_ratios", ratios, len(budgets), num_groups)
    expected = budget_math.split_ratios(budgets, groups)
    for li, (row, want) in enumerate(zip(ratios, expected, strict=True)):
        if any(not math.isclose(x, y, abs_tol=1e-6) for x, y in zip(row, want, strict=True)):
            raise ProfileError(
                f"split_ratios[{li}] = {list(row)} does not match the budgets and groups "
                f"(expected {list(want)}); recompute it with budgets.split_ratios() or "
                f"set it to null"
            )
    return ratios


def check_groups(groups: Any, num_layers: int, num_heads: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[L][G][H_p] head groups: every layer a partition of the heads into equal-sized groups."""
    ok = is_sequence(groups) and all(
        is_sequence(layer) and all(is_sequence(g) for g in layer) for layer in groups
    )
    if not ok:
        raise ProfileError(
            f"groups must be a list (layers) of lists (groups) of lists of head indices, got {groups!r:.80}"
        )
    if len(groups) != num_layers:
        raise ProfileError(f"groups has {len(groups)} layers, budgets has {num_layers}")
    result = tuple(_check_layer_groups(li, layer, num_heads) for li, layer in enumerate(groups))
    sizes = {len(layer[0]) for layer in result}
    if len(sizes) > 1:
        raise ProfileError(f"every layer must use the same group size, got sizes {sorted(sizes)}")
    return result


def _check_layer_groups(
    layer: int, layer_groups: Sequence[Sequence[Any]], num_heads: int
) -> tuple[tuple[int, ...], ...]:
    heads = [h for g in layer_groups for h in g]
    if any(isinstance(h, bool) or not isinstance(h, int) for h in heads):
        raise ProfileError(f"groups[{layer}] contains a non-integer head index: {layer_groups!r}")
    if sorted(heads) != list(range(num_heads)):
        raise ProfileError(
            f"groups[{layer}] = {as_lists(layer_groups)} is not a partition of the KV heads "
            f"0..{num_heads - 1}: every head must appear in exactly one group"
        )
    sizes = {len(g) for g in layer_groups}
    if len(sizes) != 1:
        raise ProfileError(
            f"groups[{layer}] has groups of unequal sizes {sorted(sizes)}; all groups must "
            f"have heads_per_group heads"
        )
    return tuple(tuple(g) for g in layer_groups)


def check_jsonable(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{name} must be JSON-serialisable: {exc}") from exc


def check_header(data: dict[str, Any]) -> None:
    """The format marker, a readable version, the required keys and no unknown ones."""
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileError(
            f"not an sgl-ragged profile: 'format' is {data.get('format')!r}, "
            f"expected {PROFILE_FORMAT!r}"
        )
    if data.get("version") not in READABLE_VERSIONS:
        raise ProfileError(
            f"unsupported profile version {data.get('version')!r}; this sgl-ragged reads "
            f"versions {list(READABLE_VERSIONS)}: re-calibrate or use a matching sgl-ragged"
        )
    required = {"model", "source", "budgets", "groups"}
    known = required | {"format", "version", "mu", "sigma", "split_ratios", "stats"}
    if data["version"] >= 2:
        known |= {"tiers"}
    missing = sorted(required - data.keys())
    if missing:
        raise ProfileError(f"missing key(s) {missing}")
    unknown = sorted(data.keys() - known)
    if unknown:
        raise ProfileError(f"unknown key(s) {unknown}; known keys are {sorted(known)}")


def check_heads_per_group(num_heads: int, heads_per_group: int) -> None:
    try:
        budget_math.check_heads_per_group(num_heads, heads_per_group)
    except ValueError as exc:
        raise ProfileError(str(exc)) from exc
