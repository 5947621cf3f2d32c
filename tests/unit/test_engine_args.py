"""The ragged flags as sglang.Engine keywords (config.move_keyword_args_to_env, serving/engine_args).
The engine itself: tests/e2e/test_engine.py."""

from __future__ import annotations

import os

import pytest

from sgl_ragged import config
from sgl_ragged.config import move_keyword_args_to_env


@pytest.fixture
def clean_env(monkeypatch):
    for flag in config.FLAGS:
        monkeypatch.delenv(flag.env, raising=False)
    monkeypatch.setattr(config, "_SET_FROM_KEYWORDS", {})
    yield
    move_keyword_args_to_env({})  # undo what the test's keywords set


def test_keywords_move_to_the_environment(clean_env, monkeypatch):
    kwargs = {"model_path": "m", "ragged_profile": "uniform:0.3", "ragged_window_pages": 2,
              "ragged_check_integrity": True, "ragged_heads_per_group": None}
    move_keyword_args_to_env(kwargs)
    assert kwargs == {"model_path": "m"}  # ServerArgs gets only its own fields
    assert (os.environ["RAGGED_PROFILE"], os.environ["RAGGED_WINDOW_PAGES"],
            os.environ["RAGGED_CHECK_INTEGRITY"]) == ("uniform:0.3", "2", "1")
    assert "RAGGED_HEADS_PER_GROUP" not in os.environ
    assert config.RaggedConfig.from_env().window_pages == 2


def test_each_engine_gets_its_own_keywords(clean_env, monkeypatch):
    monkeypatch.setenv("RAGGED_SCORER", "h2o")  # the environment's own value
    move_keyword_args_to_env({"ragged_profile": "uniform:0.3", "ragged_scorer": "snapkv"})
    assert os.environ["RAGGED_SCORER"] == "snapkv"
    move_keyword_args_to_env({"ragged_precision": "int4"})  # the next Engine of the process
    assert "RAGGED_PROFILE" not in os.environ and os.environ["RAGGED_SCORER"] == "h2o"
    assert os.environ["RAGGED_PRECISION"] == "int4"


def test_install_wraps_the_engines_server_args_once(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.entrypoints import engine
    from sglang.srt.server_args import ServerArgs

    from sgl_ragged.serving import engine_args

    monkeypatch.setattr(engine.Engine, "server_args_class", ServerArgs)
    engine_args.install()
    engine_args.install()
    wrapped = engine.Engine.server_args_class
    assert isinstance(wrapped, engine_args.KeywordServerArgs) and wrapped.wrapped is ServerArgs
    seen = {}
    monkeypatch.setattr(wrapped, "wrapped", lambda **kw: seen.update(kw) or "args")
    monkeypatch.setattr(config, "_SET_FROM_KEYWORDS", {})
    monkeypatch.delenv("RAGGED_PROFILE", raising=False)
    assert wrapped(model_path="m", ragged_profile="uniform:0.5") == "args"
    assert seen == {"model_path": "m"} and os.environ["RAGGED_PROFILE"] == "uniform:0.5"
    move_keyword_args_to_env({})
    assert "RAGGED_PROFILE" not in os.environ
