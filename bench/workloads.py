"""Multi-turn shared-context workloads in the spirit of SCBench (Li et al., 2024), built offline
and deterministically from a seed.

Each session puts one long context in its first user turn and then asks several questions;
every model answer becomes history, so turn k re-sends turns 1..k-1 and hits the prefix
cache. Tasks:

| task   | context                               | question (checked answer)                  |
|--------|---------------------------------------|--------------------------------------------|
| kv     | JSON object of UUID-like keys/values  | value of a key (the UUID)                  |
| needle | filler prose with hidden facts        | secret number of the <color> <animal>      |
| code   | a Python file of functions/constants  | what a function returns / a constant's value |
| chat   | a story                               | open questions (not scored)                |

    sessions = build_sessions(WorkloadConfig(sessions=4, turns=2, context_tokens=500), approx_counter)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from bench import corpus
from bench.tokens import TokenCounter

TASKS = ("kv", "needle", "code", "chat")
SYSTEM = {
    "kv": "Answer questions about the JSON data the user gives. Reply with the value only.",
    "needle": "Answer questions about the text the user gives. Reply with the number only.",
    "code": "Answer questions about the Python source the user gives. Reply with the number only.",
    "chat": "You are a helpful assistant. Keep answers short.",
}
CHAT_QUESTIONS = ("Summarize the story in two sentences.", "Which places does the story mention?",
                  "Suggest a short title for the story.", "Who appears most often in the story?",
                  "Continue the story with one sentence.", "What is the mood of the story?")


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate. Sessions go round-robin over `tasks`; `sessions_per_context` > 1 lets
    that many sessions of a task share one context (cross-session prefix sharing)."""

    sessions: int = 8
    turns: int = 3
    context_tokens: int = 2000
    tasks: tuple[str, ...] = TASKS
    sessions_per_context: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown or not self.tasks:
            raise ValueError(f"unknown tasks {unknown or self.tasks}; choose from {', '.join(TASKS)}")
        if self.sessions < 1 or self.turns < 1 or self.sessions_per_context < 1:
            raise ValueError("sessions, turns and sessions_per_context must be >= 1, got "
                             f"{self.sessions}, {self.turns}, {self.sessions_per_context}")
        if self.context_tokens < 50:
            raise ValueError(f"context_tokens must be >= 50, got {self.context_tokens}")


class Turn(NamedTuple):
    question: str
    answer: str | None  # expected answer; None: not scored (chat)


class Context(NamedTuple):
    text: str
    facts: tuple[tuple[str, str], ...]  # (question, answer) pairs answerable from the text
    tokens: int  # measured with the workload's counter


@dataclass(frozen=True)
class Session:
    """One user's conversation: the shared context, then `turns` questions."""

    id: int
    task: str
    context: str
    context_tokens: int
    turns: tuple[Turn, ...]

    def messages(self, turn: int, answers: Sequence[str]) -> list[dict[str, Any]]:
        """Chat messages for `turn` (0-based) given the model's answers to the earlier turns."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM[self.task]}]
        for k in range(turn + 1):
            q = self.turns[k].question
            msgs.append({"role": "user",
                         "content": f"{self.context}\n\nQuestion: {q}" if k == 0 else q})
            if k < turn:
                msgs.append({"role": "assistant", "content": answers[k]})
        return msgs


# ---- contexts of a given length ------------------------------------------------------------


def fit_units(target: int, count: TokenCounter, render: Callable[[int], str]) -> int:
    """Largest n >= 1 such that render(n), a text made of the first n units, has at most
    `target` tokens. Grows n by doubling, then bisects."""
    hi = 1
    while count(render(hi)) <= target:
        hi *= 2
    lo = hi // 2  # render(lo) fits (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(render(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return max(lo, 1)


class _Lazy:
    """An endless list of units made on demand from one rng, in order (so deterministic)."""

    def __init__(self, make: Callable[[random.Random, int], Any], rng: random.Random) -> None:
        self.make, self.rng, self.items = make, rng, []

    def __getitem__(self, n: slice) -> list[Any]:
        while len(self.items) < n.stop:
            self.items.append(self.make(self.rng, len(self.items)))
        return self.items[n]


def kv_context(rng: random.Random, target: int, count: TokenCounter) -> Context:
    pairs = _Lazy(lambda r, _: (corpus.uuid_like(r), corpus.uuid_like(r)), rng)

    def render(n: int) -> str:
        body = ",\n".join(f'  "{k}": "{v}"' for k, v in pairs[:n])
        return "JSON data:\n{\n" + body + "\n}"

    n = fit_units(target, count, render)
    text = render(n)
    facts = tuple((f'What is the value of the key "{k}"?', v) for k, v in pairs[:n])
    return Context(text, facts, count(text))


def code_context(rng: random.Random, target: int, count: TokenCounter) -> Context:
    items = _Lazy(corpus.code_item, rng)

    def render(n: int) -> str:
        return "# file: synthetic_utils.py\n\n" + "\n\n".join(it.source for it in items[:n])

    n = fit_units(target, count, render)
    text = render(n)
    return Context(text, tuple((it.question, it.answer) for it in items[:n]), count(text))


def _prose(sentences: Sequence[str], per_paragraph: int = 5) -> str:
    """Sentences joined into paragraphs of `per_paragraph`."""
    return "\n\n".join(" ".join(sentences[i:i + per_paragraph])
                       for i in range(0, len(sentences), per_paragraph))


def needle_context(rng: random.Random, target: int, count: TokenCounter, num_needles: int) -> Context:
    hidden = corpus.needles(rng, num_needles)
    filler = _Lazy(lambda r, _: corpus.sentence(r), rng)
    budget = max(target - count(" ".join(n.text for n in hidden)), 1)
    body = list(filler[:fit_units(budget, count, lambda k: _prose(filler[:k]))])
    for needle in hidden:  # each needle goes between two filler sentences at a random depth
        body.insert(rng.randrange(len(body) + 1), needle.text)
    text = _prose(body)
    facts = tuple((f"What is the secret number of the {nd.name}?", nd.value) for nd in hidden)
    return Context(text, facts, count(text))


def chat_context(rng: random.Random, target: int, count: TokenCounter) -> Context:
    filler = _Lazy(lambda r, _: corpus.sentence(r), rng)
    n = fit_units(target, count, lambda k: "Story:\n" + _prose(filler[:k]))
    text = "Story:\n" + _prose(filler[:n])
    return Context(text, tuple((q, "") for q in CHAT_QUESTIONS), count(text))


def make_context(task: str, rng: random.Random, cfg: WorkloadConfig, count: TokenCounter) -> Context:
    if task == "kv":
        return kv_context(rng, cfg.context_tokens, count)
    if task == "code":
        return code_context(rng, cfg.context_tokens, count)
    if task == "needle":
        return needle_context(rng, cfg.context_tokens, count, cfg.turns + 2)
    return chat_context(rng, cfg.context_tokens, count)


# ---- sessions ------------------------------------------------------------------------------


def build_sessions(cfg: WorkloadConfig, count: TokenCounter) -> list[Session]:
    """The whole workload; the same config and counter always give the same sessions."""
    contexts: dict[tuple[str, int], Context] = {}
    sessions = []
    for i in range(cfg.sessions):
        task = cfg.tasks[i % len(cfg.tasks)]
        group = (i // len(cfg.tasks)) // cfg.sessions_per_context
        if (task, group) not in contexts:
            ctx_rng = random.Random(f"{cfg.seed}:{task}:context:{group}")
            contexts[task, group] = make_context(task, ctx_rng, cfg, count)
        ctx = contexts[task, group]
        facts = random.Random(f"{cfg.seed}:{task}:session:{i}").sample(
            ctx.facts, min(cfg.turns, len(ctx.facts)))
        turns = tuple(Turn(q, a if task != "chat" else None) for q, a in facts)
        turns += tuple(Turn(CHAT_QUESTIONS[k % len(CHAT_QUESTIONS)], None)
                       for k in range(len(turns), cfg.turns))  # a tiny context ran out of facts
        sessions.append(Session(i, task, ctx.text, ctx.tokens, turns))
    return sessions


# ---- answer checking -----------------------------------------------------------------------


def normalize(text: str) -> str:
    """Lower case, punctuation other than '-' and '_' dropped, whitespace collapsed."""
    text = re.sub(r"[^\w\s-]", " ", text.lower())
    return " ".join(text.split())


class Score(NamedTuple):
    exact: bool  # normalized output equals the normalized answer
    contains: bool  # the normalized answer occurs in the normalized output


def score_answer(output: str, expected: str) -> Score:
    out, want = normalize(output), normalize(expected)
    return Score(out == want, bool(want) and want in out)
