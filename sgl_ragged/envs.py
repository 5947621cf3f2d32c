"""Settings read from the environment, shared by packages that may not import each other
(compat/ imports native/): a leaf module, importing nothing of sgl_ragged."""

from __future__ import annotations

import os
from collections.abc import Mapping


def env_choice(name: str, choices: dict[str, str], default: str = "auto",
               env: Mapping[str, str] | None = None) -> str:
    """Environment variable `name` of `env` (default os.environ; unset or empty: `default`),
    one of `choices` (value -> what it does); ValueError naming them all for any other value."""
    env = os.environ if env is None else env
    value = env.get(name, default) or default
    if value not in choices:
        raise ValueError(f"{name}={value} is not a choice: set it to "
                         + "; ".join(f"{k} ({v})" for k, v in choices.items()))
    return value
