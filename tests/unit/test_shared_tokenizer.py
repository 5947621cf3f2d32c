"""compat/shared_tokenizer.py: a scheduler's constructor loads its tokenizer once, not twice.

Fake loads stand in for SGLang's get_tokenizer in the scheduler's and the model worker's
modules (the real modules, patched), and a fake constructor calls them as SGLang's does; the
served check is tests/e2e/test_serving.py's log test.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("sglang")

from sgl_ragged.compat import shared_tokenizer  # noqa: E402
from sgl_ragged.compat.shared_tokenizer import MODULES, share_tokenizers  # noqa: E402


@pytest.fixture
def loads(monkeypatch):
    """Every load the fake get_tokenizer ran, as (args, kwargs); both modules get the same
    function, as SGLang's modules import the same one."""
    ran: list[tuple[tuple, dict]] = []

    def fake_get_tokenizer(*args, **kwargs):
        ran.append((args, kwargs))
        return object()

    for name in MODULES:
        monkeypatch.setattr(importlib.import_module(name), "get_tokenizer", fake_get_tokenizer)
    return ran, fake_get_tokenizer


def _modules():
    return [importlib.import_module(name) for name in MODULES]


def test_identical_calls_in_the_constructor_share_one_load(loads, caplog):
    ran, fake = loads
    scheduler, tp_worker = _modules()
    seen = {}

    def constructor(obj, path):
        kwargs = {"tokenizer_mode": "auto", "trust_remote_code": False, "revision": None}
        seen["scheduler"] = scheduler.get_tokenizer(path, **kwargs)
        seen["worker"] = tp_worker.get_tokenizer(path, **kwargs)
        seen["other mode"] = tp_worker.get_tokenizer(path, **{**kwargs, "tokenizer_mode": "slow"})
        seen["other path"] = scheduler.get_tokenizer(path + "-draft", **kwargs)
        seen["unhashable"] = scheduler.get_tokenizer(path, extra=["a"])
        seen["unhashable again"] = scheduler.get_tokenizer(path, extra=["a"])
        return obj

    sentinel = object()
    with caplog.at_level("INFO", logger=shared_tokenizer.__name__):
        assert share_tokenizers(constructor, sentinel, "/models/m") is sentinel
    assert seen["scheduler"] is seen["worker"]
    distinct = [seen[k] for k in ("scheduler", "other mode", "other path", "unhashable",
                                  "unhashable again")]
    assert len({id(t) for t in distinct}) == len(distinct)
    assert len(ran) == 5  # six calls, the worker's shared
    assert "1 of 6 get_tokenizer calls shared an earlier load" in caplog.text
    assert all(module.get_tokenizer is fake for module in (scheduler, tp_worker))


def test_loads_are_not_shared_across_constructors(loads):
    """Another constructor (another scheduler in this process) loads its own, and so does any
    call after the constructor."""
    ran, _ = loads
    scheduler, tp_worker = _modules()

    def constructor(path):
        return scheduler.get_tokenizer(path), tp_worker.get_tokenizer(path)

    first = share_tokenizers(constructor, "/models/m")
    second = share_tokenizers(constructor, "/models/m")
    assert first[0] is first[1] and second[0] is second[1]
    assert first[0] is not second[0]
    outside = scheduler.get_tokenizer("/models/m")
    assert outside is not first[0] and len(ran) == 3


def test_a_failed_constructor_puts_the_modules_back(loads):
    _, fake = loads
    scheduler, tp_worker = _modules()

    def constructor():
        scheduler.get_tokenizer("/models/m")
        raise RuntimeError("model failed to load")

    with pytest.raises(RuntimeError, match="model failed to load"):
        share_tokenizers(constructor)
    assert scheduler.get_tokenizer is fake and tp_worker.get_tokenizer is fake


def test_sglang_constructors_call_the_module_functions():
    """The hook works only while SGLang's scheduler and model worker call get_tokenizer as a
    global of their own modules with the same arguments: their source says so."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker

    args = ("get_serving().tokenizer_path,", "tokenizer_mode=get_serving().tokenizer_mode,",
            "trust_remote_code=get_model().trust_remote_code,", "revision=get_model().revision,",
            "tokenizer_backend=get_serving().tokenizer_backend,")
    for source in (inspect.getsource(Scheduler.init_tokenizer),
                   inspect.getsource(TpModelWorker.__init__)):
        call = source[source.index("self.tokenizer = get_tokenizer("):]
        call = call[:call.index(")\n")]
        assert [line.strip() for line in call.splitlines()[1:] if line.strip()] == list(args)
