"""The plugin's hooks point at SGLang code that exists in the pinned version, and fit it.

HookRegistry patches targets by dotted path when plugins load; a renamed SGLang method would
leave its hook silently unapplied in some process, and a changed signature would make the hook
raise TypeError on every call. Every target must resolve to a callable whose arguments the
hook accepts in the form its hook type passes them.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("sglang")

from sglang.srt.plugins.hook_registry import HookType  # noqa: E402

from sgl_ragged.serving.plugin import guard_hook_table, hook_table  # noqa: E402

ALL_HOOKS = hook_table() + guard_hook_table()


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


def _call(target: object, kind: HookType) -> tuple[list[object], dict[str, object]]:
    """Placeholder arguments as HookRegistry's wrapper hands them to the hook: the target's
    required parameters (self included; keyword-only ones by name), after the original function
    (AROUND) or its result (AFTER)."""
    params = [p for p in inspect.signature(target).parameters.values() if p.default is p.empty]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: object() for p in params if p.kind == p.KEYWORD_ONLY}
    lead = {HookType.AROUND: [target], HookType.AFTER: [None]}.get(kind, [])
    return [*lead, *(object() for _ in positional)], keywords


@pytest.mark.parametrize("target,hook,kind", ALL_HOOKS, ids=[t for t, _, _ in ALL_HOOKS])
def test_hook_fits_its_target(target, hook, kind):
    original = _resolve(target)
    assert callable(original), target
    args, kwargs = _call(original, kind)
    inspect.signature(hook).bind(*args, **kwargs)  # TypeError if it does not fit


def test_async_targets_get_async_hooks():
    """An AROUND hook on a coroutine function must return an awaitable (it is awaited)."""
    for target, hook, kind in ALL_HOOKS:
        if kind == HookType.AROUND and inspect.iscoroutinefunction(_resolve(target)):
            assert inspect.iscoroutinefunction(hook), target
