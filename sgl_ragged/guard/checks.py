"""What the request guard refuses: fields of a generate request that would crash the scheduler.

Stock SGLang 0.5.23 lets these reach the model and the sampler, where they raise in the
scheduler process and take the whole server down (issue 12):

| field | crash |
|---|---|
| `input_ids` outside [0, vocab) | `IndexError` in the embedding |
| empty input (`text` "", `input_ids` []) | `cannot reshape tensor of 0 elements` in RoPE |
| `top_logprobs_num` above the vocabulary | `selected index k out of range` in `topk` |
| `logprob_start_len` beyond the input | the prompt-logprob slices of the first prefill |
| `/generate` batch shapes SGLang cannot index (`n` < 1, text and ids batches mixed) | `IndexError` in the HTTP server (500, or a stream cut off) |
| `n` (parallel samples) in the tens of thousands | the HTTP server's process runs out of memory |

Every check raises `RequestRejected` (a ValueError, which SGLang's HTTP layer answers with a
400) whose message names the field and its allowed range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# OpenAI's documented ranges of its logprob fields (chat `top_logprobs`, completions `logprobs`).
OPENAI_TOP_LOGPROBS_MAX = {"top_logprobs": 20, "logprobs": 5}
# Parallel samples per request (`n`): OpenAI's limit. SGLang expands n into n requests in the
# HTTP server's process; n = 49152 took 11 GB there before the OOM killer ended it.
MAX_SAMPLES = 128


class RequestRejected(ValueError):
    """A request the guard refuses; `field` names the offending request field."""

    status_code = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GenerateFields:
    """The guarded fields of one (not batched) generate request, as SGLang holds them."""

    input_ids: Sequence[Any] | None  # token ids (sent by the client or tokenized), or None
    text: str | None = None  # the client's text, if it sent text
    top_logprobs_num: Any = None
    logprob_start_len: Any = None
    return_logprob: bool = False


def check_generate(req: GenerateFields, vocab_size: int) -> None:
    """Raise RequestRejected for the first field of `req` that would crash the scheduler."""
    if (req.input_ids is None and req.text == "") or (req.input_ids is not None and not req.input_ids):
        raise _empty(req.text)
    if req.input_ids is not None:
        check_input_ids(req.input_ids, vocab_size)
    check_int_range("top_logprobs_num", req.top_logprobs_num, 0, vocab_size)
    if req.return_logprob and req.input_ids is not None:
        check_int_range("logprob_start_len", req.logprob_start_len, -1, len(req.input_ids) - 1,
                        note=" (-1: no prompt logprobs; else a position of the input)")


def _empty(text: str | None) -> RequestRejected:
    if text is None:
        return RequestRejected("input_ids", "input_ids is empty: a request needs at least one token")
    return RequestRejected("text", f"text {text[:40]!r} tokenizes to no token: a request needs at "
                                   "least one token")


def check_input_ids(input_ids: Sequence[Any], vocab_size: int) -> None:
    """Token ids: a list of integers in [0, vocab_size)."""
    if not isinstance(input_ids, (list, tuple)):
        raise RequestRejected("input_ids", f"input_ids = {input_ids!r} is not a list of token ids")
    for i, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise RequestRejected(
                "input_ids", f"input_ids[{i}] = {token!r} is not a token id: token ids are "
                f"integers in [0, {vocab_size}) (the model's vocabulary)")


def check_int_range(field: str, value: Any, low: int, high: int | None, note: str = "") -> None:
    """`value` is None (unset) or an integer in [low, high] (high None: no upper bound)."""
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestRejected(field, f"{field} = {value!r} is out of range: it must be an integer "
                                     f"{allowed}{note}")


def check_sampling_params(params: Any) -> None:
    """`n` of /generate's sampling_params (a dict, or a list of them for a batch)."""
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict):
            check_samples("sampling_params.n", item.get("n"))


def check_samples(field: str, n: Any) -> None:
    """Parallel samples in [1, MAX_SAMPLES]: below 1 SGLang's batch expansion indexes past its
    lists, far above it the expansion exhausts the server's memory."""
    check_int_range(field, n, 1, MAX_SAMPLES)


def check_openai_top_logprobs(field: str, value: Any) -> None:
    """An OpenAI logprob count within OpenAI's documented range (`top_logprobs` 0-20)."""
    check_int_range(field, value, 0, OPENAI_TOP_LOGPROBS_MAX[field], note=" (the OpenAI API's range)")
