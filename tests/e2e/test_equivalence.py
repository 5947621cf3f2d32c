"""The end-to-end oracle: at ratio 1.0 nothing is dropped, so in float32 the ragged backend must
reproduce stock SGLang's torch_native greedy output token for token, logprobs within 1e-3, and
the prompt's own log-probabilities (`logprob_start_len` 0) at every position, chunk by chunk,
and what SGLang's request features read from the forward (hidden states, a custom logit
processor, /v1/score)."""

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



def _features(base_url: str, banned: list[int]) -> dict[str, object]:
    """What SGLang's request features give for the chunked prompt: the hidden states of its
    prefill and decode steps, greedy ids with a custom logit processor that bans `banned`, and
    /v1/score of two continuations."""
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    hidden = post(base_url, "/generate", {"text": PROMPTS[1], "return_hidden_states": True,
                                          "sampling_params": sampling})
    kept = post(base_url, "/generate", {
        "text": PROMPTS[1], "custom_logit_processor": DisallowedTokensLogitsProcessor.to_str(),
        "return_logprob": True,
        "sampling_params": {**sampling, "custom_params": {"token_ids": banned}}})
    scored = post(base_url, "/v1/score", {"model": "default", "query": PROMPTS[1],
                                          "items": [" 12", " the code"],
                                          "label_token_ids": [28, 29, 30], "apply_softmax": True})
    return {"hidden": _hidden_rows(hidden["meta_info"]["hidden_states"]),
            "ids": [e[1] for e in kept["meta_info"]["output_token_logprobs"]],
            "scores": scored["scores"]}


def _hidden_rows(steps: list) -> list[list[float]]:
    """return_hidden_states' steps as rows: the prefill's one per prompt token, then one per
    decode step."""
    return [row for step in steps for row in (step if isinstance(step[0], list) else [step])]


def test_request_features_match_torch_native(oracle_pair):
    ragged, native = oracle_pair
    banned = _greedy(native.base_url, PROMPTS[1])[0][:2]  # stock's first two greedy tokens
    got, want = _features(ragged.base_url, banned), _features(native.base_url, banned)
    assert len(got["hidden"]) == len(want["hidden"]) > 8  # prefill rows, then 7 decode steps
    assert max(abs(x - y) for a, b in zip(got["hidden"], want["hidden"], strict=True)
               for x, y in zip(a, b, strict=True)) < 1e-3
    assert got["ids"] == want["ids"] and not set(banned) & set(got["ids"])
    assert max(abs(x - y) for a, b in zip(got["scores"], want["scores"], strict=True)
               for x, y in zip(a, b, strict=True)) < 1e-4
