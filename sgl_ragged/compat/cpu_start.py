"""A CPU server's scheduler and detokenizer processes started by fork instead of spawn (opt-in).

SGLang 0.5.23 starts its children with multiprocessing's spawn method (`_set_envs_and_config`):
a process that has initialised CUDA cannot fork. A spawned child starts a fresh interpreter and
imports SGLang again, torch, transformers, flashinfer and the model registry: about 20-35
CPU-seconds a child on a 2 GHz Zen 1, two thirds of a server start. On the CPU nothing needs
that: when it starts its children, the launcher has imported all of it, so a forked child starts
from its modules (measured on that machine, the README's server, `bench.server_start`: 43
CPU-seconds a start instead of 94, ready after 40 s instead of 67; docs/results.md, "Server
starts by fork on the CPU").

`launch_processes`, around Engine's two launch methods (schedulers, with the data-parallel
controller where there is one, and detokenizers), sets the start method for their duration
(`start_method`). It forks only where all of these hold, else spawns as SGLang does:
- the server's device is the CPU;
- this process is a server's launcher (`python -m sglang.launch_server`, `sglang serve`) and
  runs no Python thread besides the main one. A fork copies only the calling thread: a lock
  another thread held stays held in the child, and torch's OpenMP workers, once a parallel
  operator has started them, are missing in the child, whose next parallel operator waits for
  them forever. A launcher has run no such operator; its other threads are numpy's and
  scipy's OpenBLAS servers, which stop around a fork themselves (pthread_atfork). A program
  that builds an in-process `sglang.Engine` may have run anything, so it spawns;
- nothing must run in front of the child's interpreter (SGLANG_NUMA_BIND_V2's numactl,
  `--enable-memory-saver`'s preload);
- RAGGED_CPU_START_METHOD is `fork`. It is not the default: the README's server, forked,
  decodes about 3% slower than spawned (session 54, under scripts/env.sh: two servers up at
  once, 24 requests of 96 tokens alternating between them, forked/spawned 1.031 on average,
  18 of 24 pairs slower forked; not explained yet, and the scheduler's CPU-seconds matched),
  so users get SGLang's spawn unless they ask; the test suite forks (tests/conftest.py),
  where a start's CPU time is what counts.
Every forked child takes spawn as its own method again (`os.register_at_fork`), so what it
starts (the data-parallel controller launches its schedulers from threads) spawns as in SGLang.
The plugin installs the hook in every SGLang process of the environment, stock servers too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from sgl_ragged.envs import env_choice

logger = logging.getLogger(__name__)

ENV = "RAGGED_CPU_START_METHOD"
CHOICES = {"spawn": "spawn a server's children as SGLang does (each imports SGLang again)",
           "fork": "fork a CPU server's children where it is safe, else spawn"}
NUMA_ENV = "SGLANG_NUMA_BIND_V2"
LAUNCHER_MODULES = ("sglang.launch_server",)
_state = {"at_fork_registered": False}


def is_server_launcher() -> bool:
    """Whether this process runs `python -m sglang.launch_server` or `sglang serve`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in LAUNCHER_MODULES:
        return True
    return os.path.basename(sys.argv[0]) == "sglang" and sys.argv[1:2] == ["serve"]


def start_method(device: str | None, memory_saver: bool = False) -> tuple[str, str]:
    """(start method, why) for the children a server on `device` starts now."""
    if env_choice(ENV, CHOICES, default="spawn") == "spawn":
        return "spawn", f"{ENV}=spawn, the default"
    if not str(device or "").startswith("cpu"):
        return "spawn", f"device {device}"
    if "fork" not in multiprocessing.get_all_start_methods():
        return "spawn", "this platform cannot fork"
    if os.environ.get(NUMA_ENV, "").lower() in ("1", "true", "yes", "on") or memory_saver:
        return "spawn", f"{NUMA_ENV} or --enable-memory-saver run a program before the child"
    if not is_server_launcher():
        return "spawn", "not a server's launcher (an in-process Engine)"
    if threading.active_count() != 1:
        return "spawn", f"the launcher runs {threading.active_count()} Python threads"
    return "fork", "a CPU server's launcher"


def launch_processes(original: Callable[..., Any], cls: type, server_args: Any,
                     *args: Any, **kwargs: Any) -> Any:
    """AROUND Engine._launch_scheduler_processes / _launch_detokenizer_subprocesses: run them
    under `start_method`'s choice, then put the process's previous method back."""
    method, why = start_method(getattr(server_args, "device", None),
                               bool(getattr(server_args, "enable_memory_saver", False)))
    logger.info("%s: child processes start by %s (%s)", original.__name__, method, why)
    if method == "fork" and not _state["at_fork_registered"]:
        os.register_at_fork(after_in_child=_spawn_from_here)
        _state["at_fork_registered"] = True
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        return original(cls, server_args, *args, **kwargs)
    finally:
        multiprocessing.set_start_method(previous, force=True)


def _spawn_from_here() -> None:
    """In a forked child: what it starts spawns, as in SGLang."""
    multiprocessing.set_start_method("spawn", force=True)
