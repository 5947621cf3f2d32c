"""A stand-in for bench.multiturn._deployment: servers that record their starts and stops
instead of running (tests of the launch order, --start-together and --rounds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fake_deployments(events: list[tuple], refuse: Callable[[str, int], None] | None = None,
                     ) -> tuple[type, dict[str, int]]:
    """A deployment class for monkeypatching `multiturn._deployment`, and its start attempts
    per label. Entering one appends ("up", label) to `events` (exiting, ("down", label)) after
    `refuse(label, attempt)`, which may raise to fail that start (attempts count from 1)."""
    attempts: dict[str, int] = {}

    class Fake:
        def __init__(self, target: Any, server_args: list[str], env: dict, log: Any) -> None:
            self.label, self.base_url = target.label, f"http://{target.label}"

        def __enter__(self) -> Fake:
            attempts[self.label] = attempts.get(self.label, 0) + 1
            if refuse is not None:
                refuse(self.label, attempts[self.label])
            events.append(("up", self.label))
            return self

        def __exit__(self, *exc: object) -> None:
            events.append(("down", self.label))

    return Fake, attempts
