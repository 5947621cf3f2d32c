"""The end-to-end oracle: at ratio 1.0 nothing is dropped, so in float32 the ragged backend must
reproduce stock SGLang's torch_native greedy output token for token, logprobs within 1e-3, and
the prompt's own log-probabilities (`logprob_start_len` 0) at every position, chunk by chunk."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import post
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The three primary colors are",
    # Longer than one 256-token prefill chunk: earlier chunks are sealed, the last keeps its window.
    FACTS + "\nQuestion: what is the code of item 12? Answer:",
]


def _greedy(base_url: str, prompt: str | dict) -> tuple[list[int], list[float]]:
    """Greedy output ids and log-probabilities (72 tokens, to length) of a prompt: its text, or
    the request's input fields (e.g. input_ids or input_embeds)."""
    out = post(base_url, "/generate", {
        **({"text": prompt} if isinstance(prompt, str) else prompt), "return_logprob": True,
        "sampling_params": {"max_new_tokens": 72, "temperature": 0, "ignore_eos": True},
    })
    entries = out["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked"])
def test_ratio_one_matches_torch_native(oracle_pair, prompt):
    ragged, native = oracle_pair
    ids_r, lp_r = _greedy(ragged.base_url, prompt)
    ids_n, lp_n = _greedy(native.base_url, prompt)
    assert ids_r == ids_n
    assert max(abs(a - b) for a, b in zip(lp_r, lp_n, strict=True)) < 1e-3


def _prompt_logprobs(base_url: str, prompt: str) -> tuple[list[int], list[float]]:
    """The prompt's own tokens and their log-probabilities (input_token_logprobs from its first
    token on; the first has none), with the top 5 of the first output token's."""
    out = post(base_url, "/generate", {
        "text": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    entries = out["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None
    top = out["meta_info"]["output_top_logprobs"][0]
    return [e[1] for e in entries] + [e[1] for e in top], [e[0] for e in entries[1:]] + [e[0] for e in top]


def test_prompt_logprobs_match_torch_native(oracle_pair):
    """Every prompt position's log-probability, chunk after chunk of the chunked prompt (each
    chunk's logits attend to the earlier chunks' sealed pages), and the top-5 alternatives of
    the next token, as torch_native gives them."""
    ragged, native = oracle_pair
    ids_r, lp_r = _prompt_logprobs(ragged.base_url, PROMPTS[1])
    ids_n, lp_n = _prompt_logprobs(native.base_url, PROMPTS[1])
    assert ids_r == ids_n and len(lp_r) > 256 + 5
    assert max(abs(a - b) for a, b in zip(lp_r, lp_n, strict=True)) < 1e-3
