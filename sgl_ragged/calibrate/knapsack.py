"""Byte allocation across head groups: one option per group, the least total error within a
total byte budget (a multiple-choice knapsack, solved exactly by dynamic programming over bytes).

The per-head precision search (calibrate/precision_search.py) gives every (layer, group) a list
of options (a row composition and its low format), each with its bytes per page and its
measured error; `allocate` picks one option per group. Bytes are integers and their common
divisor is factored out, so the table has budget / gcd + 1 entries per group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Allocation:
    """One option index per group, their total bytes and total error."""

    choice: tuple[int, ...]
    bytes: int
    error: float


def allocate(costs: Sequence[Sequence[int]], errors: Sequence[Sequence[float]],
             budget: int) -> Allocation:
    """The options (one per group g, index into costs[g] / errors[g]) of least total error whose
    total cost is at most `budget`. Raises ValueError if even
    the cheapest options exceed the budget."""
    if len(costs) != len(errors) or any(len(c) != len(e) or not c for c, e in zip(costs, errors, strict=True)):
        raise ValueError("every group needs at least one option, with one error per cost")
    if any(c < 0 for cs in costs for c in cs):
        raise ValueError("option costs must be non-negative bytes")
    cheapest = sum(min(cs) for cs in costs)
    if cheapest > budget:
        raise ValueError(f"the cheapest options take {cheapest} bytes, over the budget of {budget}")
    unit = math.gcd(*(c for cs in costs for c in cs if c)) or 1
    size = budget // unit + 1
    dp = np.zeros(size)  # dp[b]: least error of the groups so far with total cost <= b units
    picks = np.empty((len(costs), size), dtype=np.int32)
    for g, (cs, es) in enumerate(zip(costs, errors, strict=True)):
        new = np.full(size, np.inf)
        pick = np.full(size, -1, dtype=np.int32)
        for i in sorted(range(len(cs)), key=lambda i: cs[i]):  # ties: the cheaper option first
            c = cs[i] // unit
            if c >= size:
                continue
            cand = dp[: size - c] + es[i]
            better = cand < new[c:]
            new[c:][better] = cand[better]
            pick[c:][better] = i
        dp, picks[g] = new, pick
    b = size - 1
    choice = []
    for g in range(len(costs) - 1, -1, -1):
        i = int(picks[g][b])
        choice.append(i)
        b -= costs[g][i] // unit
    choice.reverse()
    total = sum(cs[i] for cs, i in zip(costs, choice, strict=True))
    return Allocation(tuple(choice), total, float(sum(es[i] for es, i in zip(errors, choice, strict=True))))
