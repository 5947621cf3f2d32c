"""Where the request guard runs (main process, only with `--attention-backend ragged`).

| hook | requests | when |
|---|---|---|
| AROUND `http_server.serve_generate_request` | `/generate` bodies (normalized on a copy) | before a stream opens: a real 400 |
| AFTER `OpenAIServingChat/Completion._convert_to_internal_request` | `/v1/chat/completions`, `/v1/completions` | after templating, before a stream opens |
| BEFORE `TokenizerManager._validate_one_request` | every request, batch items too | after tokenization: text that tokenizes to nothing, the Engine API |

The last one alone would suffice for safety, but a streamed request that fails there gets its
error as an SSE event of a 200 response (SGLang's convention), so the first two answer what
they can before the response starts.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from sgl_ragged.guard.checks import (
    GenerateFields,
    RequestRejected,
    check_generate,
    check_openai_top_logprobs,
    check_samples,
    check_sampling_params,
)
from sgl_ragged.serving.server_args import is_active

if TYPE_CHECKING:
    from fastapi import Request
    from sglang.srt.managers.io_struct import GenerateReqInput


def single_fields(obj: GenerateReqInput) -> GenerateFields | None:
    """The guarded fields of a client's GenerateReqInput, or None for a batch request."""
    ids, text = obj.input_ids, obj.text
    if isinstance(text, list) or (ids and isinstance(ids[0], list)):
        return None
    return GenerateFields(input_ids=ids, text=text, top_logprobs_num=obj.top_logprobs_num,
                          logprob_start_len=obj.logprob_start_len,
                          return_logprob=bool(obj.return_logprob))


def _check(obj: GenerateReqInput, vocab_size: int) -> None:
    fields = single_fields(obj)
    if fields is not None:
        check_generate(fields, vocab_size)


def check_generate_body(obj: GenerateReqInput, vocab_size: int) -> None:
    """A /generate body, single or batch: normalized on a copy as SGLang will (its errors and
    crashes there become RequestRejected), then every (sub-)request checked."""
    if obj.text is not None and obj.input_ids is not None and single_fields(obj) is None:
        raise RequestRejected("input_ids", "text and input_ids are both given and one is a batch: "
                                           "give one of them")
    check_sampling_params(obj.sampling_params)
    _check(obj, vocab_size)  # a single request: our messages before SGLang's own
    probe = copy.deepcopy(obj)
    try:
        probe.normalize_batch_and_arguments()
        items = [probe] if probe.is_single else [probe[i] for i in range(len(probe.rid))]
    except ValueError as e:
        raise RequestRejected("request", str(e)) from e
    except (AttributeError, IndexError, KeyError, TypeError) as e:  # shapes SGLang cannot index
        raise RequestRejected("request", f"malformed request ({type(e).__name__}: {e}): check that "
                                         "the batch fields are lists of one length") from e
    for item in items:
        if not isinstance(item.sampling_params, dict):
            raise RequestRejected("sampling_params", "sampling_params must be an object (a list of "
                                                     "objects, one per prompt, only for a batch)")
        _check(item, vocab_size)


async def around_serve_generate(original: Any, obj: GenerateReqInput, request: Request) -> Any:
    """AROUND http_server.serve_generate_request: a 400 naming the field, before any stream."""
    if is_active():
        from fastapi.responses import ORJSONResponse
        from sglang.srt.entrypoints.http_server import _global_state

        try:
            check_generate_body(obj, _global_state.tokenizer_manager.model_config.vocab_size)
        except RequestRejected as e:
            return ORJSONResponse(status_code=400, content={"error": {
                "message": str(e), "type": "invalid_request_error", "param": e.field, "code": 400}})
    return await original(obj, request)


def after_convert_chat(result: tuple[Any, Any], serving: Any, request: Any, *args: Any,
                       **kwargs: Any) -> None:
    """AFTER OpenAIServingChat._convert_to_internal_request (raises: SGLang answers 400)."""
    if is_active():
        check_openai_top_logprobs("top_logprobs", request.top_logprobs)
        check_samples("n", request.n)
        _check(result[0], serving.tokenizer_manager.model_config.vocab_size)


def after_convert_completion(result: tuple[Any, Any], serving: Any, request: Any, *args: Any,
                             **kwargs: Any) -> None:
    """AFTER OpenAIServingCompletion._convert_to_internal_request (raises: SGLang answers 400)."""
    if is_active():
        check_openai_top_logprobs("logprobs", request.logprobs)
        check_samples("n", request.n)
        _check(result[0], serving.tokenizer_manager.model_config.vocab_size)


def before_validate_one_request(manager: Any, obj: Any, input_ids: list[int] | None,
                                *args: Any, **kwargs: Any) -> None:
    """BEFORE TokenizerManager._validate_one_request: one (batch item's) tokenized request."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if is_active() and isinstance(obj, GenerateReqInput) and obj.input_embeds is None:
        text = obj.text if isinstance(obj.text, str) else None
        check_generate(GenerateFields(
            input_ids=input_ids, text=text, top_logprobs_num=obj.top_logprobs_num,
            logprob_start_len=obj.logprob_start_len, return_logprob=bool(obj.return_logprob),
        ), manager.model_config.vocab_size)
