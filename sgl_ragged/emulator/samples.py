"""Tokenized calibration samples of an exact length, deterministic from a seed.

A sample is a chat prompt (the model's chat template when it has one): a context of the task's
paragraphs, cut to fill the target length exactly, then the task's question. Lengths are drawn
uniformly from [min_tokens, max_tokens] and rounded down to whole pages, because serving only
compresses complete pages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_ragged.emulator.corpus import TASKS, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = "\x00CONTEXT\x00"


@dataclass(frozen=True)
class Sample:
    """One calibration context."""

    task: str  # a corpus task name ("summary", "code", "retrieval")
    input_ids: torch.Tensor  # [T] int64 token ids, T a multiple of the page size

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def build_samples(
    tokenizer: PreTrainedTokenizerBase, count: int, seed: int, min_tokens: int, max_tokens: int,
    page_size: int,
) -> list[Sample]:  # fmt: skip
    """``count`` samples, task types round-robin; sample i depends only on (seed, i)."""
    if not page_size <= min_tokens <= max_tokens:
        raise ValueError(
            f"need page_size <= min_tokens <= max_tokens, got {page_size}, {min_tokens}, "
            f"{max_tokens}"
        )
    samples = []
    for i in range(count):
        rng = random.Random(f"sgl-ragged-calibration/{seed}/{i}")
        length = rng.randint(min_tokens, max_tokens) // page_size * page_size
        samples.append(encode_sample(tokenizer, TASKS[i % len(TASKS)], rng, length))
    return samples


def encode_sample(
    tokenizer: PreTrainedTokenizerBase, task: Task, rng: random.Random, length: int
) -> Sample:
    """A prompt of exactly ``length`` tokens: template prefix, context, question, suffix."""
    paragraphs = task.paragraphs(rng)
    # 1. Measure the template around the context with a provisional question.
    prefix, suffix = _template_parts(tokenizer, "?" * 64)
    budget = length - len(prefix) - len(suffix)
    if budget < 1:
        raise ValueError(f"sample length {length} leaves no room for a context")
    # 2. Take paragraphs until the budget is full; the question is about those.
    context: list[int] = []
    kept: list[str] = []
    while len(context) < budget:
        text = next(paragraphs) + "\n\n"
        kept.append(text)
        context += _encode(tokenizer, text)
    # 3. Re-measure with the real question and cut the context to fit exactly.
    prefix, suffix = _template_parts(tokenizer, task.question(rng, kept))
    budget = length - len(prefix) - len(suffix)
    if budget < 1:
        raise ValueError(f"sample length {length} leaves no room for a context")
    while len(context) < budget:  # a shorter question than the provisional one
        context += _encode(tokenizer, next(paragraphs) + "\n\n")
    ids = prefix + context[:budget] + suffix
    return Sample(task.name, torch.tensor(ids, dtype=torch.int64))


def _template_parts(tokenizer: PreTrainedTokenizerBase, question: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the context in the prompt that asks ``question``."""
    content = f"{_PLACEHOLDER}\n\nQuestion: {question}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = content + "\nAnswer:"
    before, _, after = text.partition(_PLACEHOLDER)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and not before else []
    return bos + _encode(tokenizer, before), _encode(tokenizer, after)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
