"""The plugin's hooks point at SGLang code that exists in the pinned version.

HookRegistry patches targets by dotted path when plugins load; a renamed SGLang method would
leave its hook silently unapplied in some process. Every target must resolve to a callable.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("sglang")

from sgl_ragged.plugin import hook_table  # noqa: E402


def _resolve(target: str) -> object:
    """The attribute a dotted path names: the longest importable module, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


@pytest.mark.parametrize("target,hook,kind", hook_table(), ids=[t for t, _, _ in hook_table()])
def test_hook_targets_exist(target, hook, kind):
    assert callable(_resolve(target)), target
    assert callable(hook)
