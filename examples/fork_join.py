"""Fork/join in SGLang's frontend language: the document is sent once, then `fork` asks
several questions in parallel branches that share it as a prefix, and the join writes a
summary from the branches' answers. The frontend sends the shared prefix alone before
forking, so every branch (and the summary) finds the document's sealed pages in the radix
cache.

    python -m examples.fork_join --base-url http://127.0.0.1:30000
"""

from __future__ import annotations

from typing import Any

import sglang as sgl

from examples.common import DOCUMENT, connect, parse_args


@sgl.function
def fork_join(s: Any, document: str, items: list[int]) -> list[dict[str, Any]]:
    s += f"Document:\n{document}\n\n"
    # Wait until the text is appended: fork() sends the shared prefix to the server first (so
    # it is cached once), but only if it already sees the text.
    s.sync()
    branches = s.fork(len(items))
    for branch, item in zip(branches, items, strict=True):
        branch += f"Question: What is the code of item {item}?\nAnswer: The code of item {item} is"
        branch += sgl.gen("answer", max_tokens=8, temperature=0, stop="\n")
    branches.join()
    for branch, item in zip(branches, items, strict=True):
        s += f"Item {item}:{branch['answer']}\n"
    s += "Summary of the codes above:" + sgl.gen("summary", max_tokens=16, temperature=0)
    return [{"item": item, "answer": b["answer"], **_tokens(b.get_meta_info("answer"))}
            for b, item in zip(branches, items, strict=True)]


def _tokens(meta: dict[str, Any]) -> dict[str, int]:
    return {"cached_tokens": meta["cached_tokens"], "prompt_tokens": meta["prompt_tokens"]}


def run(base_url: str, chat_template: str = "chatml") -> dict[str, Any]:
    """Each branch's answer and cached prompt tokens, then the summary's."""
    connect(base_url, chat_template)
    state = fork_join.run(document=DOCUMENT, items=[2, 5, 9])
    return {"branches": state.ret_value, "summary": state["summary"],
            **_tokens(state.get_meta_info("summary"))}


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    out = run(args.base_url, args.chat_template)
    for b in out["branches"]:
        print(f"item {b['item']}: {b['answer']!r} "
              f"(cached {b['cached_tokens']}/{b['prompt_tokens']} prompt tokens)")
    print(f"summary: {out['summary']!r} "
          f"(cached {out['cached_tokens']}/{out['prompt_tokens']} prompt tokens)")
