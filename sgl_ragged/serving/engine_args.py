"""`sglang.Engine(..., attention_backend="ragged", ragged_profile=...)`: the ragged flags as
keywords of SGLang's offline engine.

The Engine builds its ServerArgs from its keywords (`Engine.server_args_class(**kwargs)`), and
ServerArgs has no `ragged_*` fields: it would refuse them ("Unexpected keyword argument
'ragged_profile'"). SGLang loads plugins inside Engine.__init__, just before that call, so a
hook on Engine.__init__ would come too late for the first Engine; the class attribute it reads
then is replaced instead, by `KeywordServerArgs`, which moves the keywords to the environment
(config.move_keyword_args_to_env, as the command line's flags go) and builds SGLang's own.
"""

from __future__ import annotations

import sys
from typing import Any

from sgl_ragged.config import move_keyword_args_to_env

ENGINE_MODULE = "sglang.srt.entrypoints.engine"


class KeywordServerArgs:
    """Engine.server_args_class: SGLang's ServerArgs, built after the ragged keywords leave."""

    def __init__(self, server_args_class: Any) -> None:
        self.wrapped = server_args_class

    def __call__(self, **kwargs: Any) -> Any:
        move_keyword_args_to_env(kwargs)
        return self.wrapped(**kwargs)


def install() -> None:
    """Where this process has imported SGLang's Engine (the only processes that build one):
    its ServerArgs accept the ragged keywords. Idempotent."""
    engine = sys.modules.get(ENGINE_MODULE)
    if engine is None:
        return
    current = engine.Engine.server_args_class
    if not isinstance(current, KeywordServerArgs):
        engine.Engine.server_args_class = KeywordServerArgs(current)
