"""`select` in SGLang's frontend language: constrained choices over one shared document.
Each question picks one of a few options by comparing their logprobs (the server scores every
option's tokens after the shared prompt); all of them re-use the document's cached pages,
which shows in the server's `sglang:cached_tokens_total` counter.

    python -m examples.select_program --base-url http://127.0.0.1:30000
"""

from __future__ import annotations

from typing import Any

import sglang as sgl

from examples.common import DOCUMENT, cached_tokens_total, code_of, connect, parse_args


@sgl.function
def pick_codes(s: Any, document: str, items: list[int], options: list[str]) -> None:
    s += sgl.system("You answer questions about the user's document.")
    s += sgl.user(document)
    s += sgl.assistant("I have read the document.")
    for i, item in enumerate(items):
        s += sgl.user(f"Which of these is the code of item {item}: {', '.join(options)}?")
        s += sgl.assistant(sgl.select(f"choice_{i}", choices=options))


def run(base_url: str, chat_template: str = "chatml") -> dict[str, Any]:
    """The chosen options and the prompt tokens served from the cache while choosing."""
    connect(base_url, chat_template)
    items = [4, 11]
    options = [code_of(4), code_of(11), code_of(20)]
    before = cached_tokens_total(base_url)
    state = pick_codes.run(document=DOCUMENT, items=items, options=options)
    return {"choices": [state[f"choice_{i}"] for i in range(len(items))], "options": options,
            "expected": [code_of(i) for i in items],
            "cached_tokens": cached_tokens_total(base_url) - before}


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    out = run(args.base_url, args.chat_template)
    print(f"chose {out['choices']} (expected {out['expected']}); "
          f"{out['cached_tokens']:.0f} prompt tokens came from the cache")
