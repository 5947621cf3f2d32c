"""Which pool splits the native kernels' work, as cuda_ext/pool.cpp reads the environment at its
first use: RAGGED_NATIVE_POOL (`pool`, the default: the kernels' own pool, whose caller never
waits for a worker to wake; `openmp`: torch's intra-op pool, at::parallel_for) and
RAGGED_POOL_SPIN_US (how long the pool's idle workers spin before they sleep, microseconds).

The kernel falls back to the defaults on a value it cannot read; `validate` (every server of the
environment calls it at startup, through serving/server_args) refuses one instead, with what to
set. docs/results.md, "The native kernels' own pool (session 67)", has why and what it gave."""

from __future__ import annotations

import os

from sgl_ragged.envs import env_choice

KINDS = {
    "pool": "the kernels' own pool: the caller takes the pieces itself and never waits for a "
            "worker to wake (cuda_ext/pool.cpp)",
    "openmp": "torch's intra-op pool (at::parallel_for): the caller waits for every worker",
}
SPIN_US = 100
"""The pool's default spin (pool.cpp's SPIN_US): served decode on a 2-core Zen 4 was as fast at
20 us and at 100, and two busy servers sharing the cores lost x0.93 at 500 against x1.25 at 100
(over OpenMP with GOMP_SPINCOUNT=3000)."""


def kind(env: dict[str, str] | None = None) -> str:
    """RAGGED_NATIVE_POOL (unset or empty: `pool`); ValueError naming the choices otherwise."""
    return env_choice("RAGGED_NATIVE_POOL", KINDS, default="pool", env=env)


def spin_us(env: dict[str, str] | None = None) -> int:
    """RAGGED_POOL_SPIN_US (unset or empty: SPIN_US); ValueError unless a whole number."""
    env = os.environ if env is None else env
    value = env.get("RAGGED_POOL_SPIN_US", "")
    if not value:
        return SPIN_US
    if not value.isdigit():
        raise ValueError(f"RAGGED_POOL_SPIN_US={value} is not a time: set a whole number of "
                         f"microseconds (e.g. {SPIN_US}), or unset it")
    return int(value)


def validate(env: dict[str, str] | None = None) -> None:
    """Both settings as the kernels will read them; ValueError with what to set."""
    kind(env)
    spin_us(env)
