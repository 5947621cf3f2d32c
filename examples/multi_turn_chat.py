"""Multi-turn chat in SGLang's frontend language: one document, several questions, each
answer kept in the history. Every turn re-sends the conversation so far; its sealed pages
come back from the radix cache (`cached_tokens` of each turn).

    python -m examples.multi_turn_chat --base-url http://127.0.0.1:30000
"""

from __future__ import annotations

from typing import Any

import sglang as sgl

from examples.common import DOCUMENT, connect, parse_args


@sgl.function
def multi_turn_chat(s: Any, document: str, questions: list[str]) -> None:
    s += sgl.system("You answer questions about the user's document. Be brief.")
    for i, question in enumerate(questions):
        s += sgl.user(f"{document}\n\nQuestion: {question}" if i == 0 else question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=16, temperature=0))


def run(base_url: str, chat_template: str = "chatml") -> list[dict[str, Any]]:
    """Per turn: the question, the answer and the prompt tokens the server had cached."""
    connect(base_url, chat_template)
    questions = ["What is the code of item 3?", "And the code of item 7?", "And of item 12?"]
    state = multi_turn_chat.run(document=DOCUMENT, questions=questions)
    return [{"question": q, "answer": state[f"answer_{i}"],
             "cached_tokens": state.get_meta_info(f"answer_{i}")["cached_tokens"],
             "prompt_tokens": state.get_meta_info(f"answer_{i}")["prompt_tokens"]}
            for i, q in enumerate(questions)]


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    for turn in run(args.base_url, args.chat_template):
        print(f"{turn['question']!r} -> {turn['answer']!r} "
              f"(cached {turn['cached_tokens']}/{turn['prompt_tokens']} prompt tokens)")
