"""One tokenizer load for a scheduler process, where SGLang 0.5.23 loads the same one twice.

A scheduler's constructor loads the served model's tokenizer (`Scheduler.init_tokenizer`) and
then builds its model worker, whose constructor loads it again with the same arguments
(`TpModelWorker.__init__`) and keeps it unused: nothing in SGLang reads a model worker's
tokenizer. Each `get_tokenizer` runs three `from_pretrained` loads of the tokenizer files (about
1.1 s for SmolLM2's on a 2-core Zen 3, json parsing and deep copies of the Rust tokenizer), all
of it on the path to a server's first request, with every attention backend.

`share_tokenizers`, around `Scheduler.__init__`, has the two share one load: while the
constructor runs, `get_tokenizer` in the scheduler's and the model worker's modules returns the
tokenizer already loaded with the same arguments in that constructor, and loads it otherwise.
Afterwards both modules have their own `get_tokenizer` back, so a later call (an in-process
caller's, another scheduler's) loads as before. Processors (multimodal models) are not shared:
the two constructors load them with different arguments.

The plugin installs the hook in every SGLang process of the environment, stock servers too.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger(__name__)

MODULES = ("sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker")
"""Modules whose `get_tokenizer` a scheduler's constructor calls (each imports it by name)."""


def _load_key(load: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> Hashable | None:
    """What identifies one load (the function and its arguments), None where the arguments
    cannot be compared (unhashable: then the call loads as usual)."""
    key = (id(load), args, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def sharing(load: Callable[..., Any], loaded: dict[Hashable, Any], counts: dict[str, int]
            ) -> Callable[..., Any]:
    """`load` (a get_tokenizer), returning what an identical earlier call put in `loaded`;
    counts its calls and the shared ones in `counts`."""

    def get_tokenizer(*args: Any, **kwargs: Any) -> Any:
        counts["calls"] += 1
        key = _load_key(load, args, kwargs)
        if key is None:
            return load(*args, **kwargs)
        if key in loaded:
            counts["shared"] += 1
        else:
            loaded[key] = load(*args, **kwargs)
        return loaded[key]

    get_tokenizer.__wrapped__ = load  # type: ignore[attr-defined]
    return get_tokenizer


def share_tokenizers(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.__init__: identical get_tokenizer calls during the constructor share
    one load; the modules' own functions are put back afterwards, failed or not."""
    modules = [importlib.import_module(name) for name in MODULES]
    own = [module.get_tokenizer for module in modules]
    loaded: dict[Hashable, Any] = {}
    counts = {"calls": 0, "shared": 0}
    for module, load in zip(modules, own, strict=True):
        module.get_tokenizer = sharing(load, loaded, counts)
    try:
        result = original(*args, **kwargs)
    finally:
        for module, load in zip(modules, own, strict=True):
            module.get_tokenizer = load
    if counts["shared"]:
        logger.info("Scheduler: %d of %d get_tokenizer calls shared an earlier load",
                    counts["shared"], counts["calls"])
    return result
