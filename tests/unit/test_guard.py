"""The request guard's checks (sgl_ragged/guard/checks.py): what is refused, and the message."""

from __future__ import annotations

import pytest

from sgl_ragged.guard.checks import (
    GenerateFields,
    RequestRejected,
    check_generate,
    check_openai_top_logprobs,
    check_sampling_params,
)

VOCAB = 100


def _rejected(fields: GenerateFields) -> RequestRejected:
    with pytest.raises(RequestRejected) as err:
        check_generate(fields, VOCAB)
    assert err.value.status_code == 400
    return err.value


@pytest.mark.parametrize("ids,index,shown", [
    ([5, 100], 1, "100"), ([-1], 0, "-1"), ([3, 4, 10**9], 2, "1000000000"),
    ([1, 2.5], 1, "2.5"), ([True], 0, "True"), (["7"], 0, "'7'"),
])
def test_token_ids_outside_the_vocabulary(ids, index, shown):
    err = _rejected(GenerateFields(input_ids=ids))
    assert err.field == "input_ids"
    assert f"input_ids[{index}] = {shown}" in str(err) and "[0, 100)" in str(err)


@pytest.mark.parametrize("fields,field", [
    (GenerateFields(input_ids=[]), "input_ids"),
    (GenerateFields(input_ids=None, text=""), "text"),  # before tokenization
    (GenerateFields(input_ids=[], text=""), "text"),  # text that tokenized to nothing
])
def test_empty_input(fields, field):
    err = _rejected(fields)
    assert err.field == field and "at least one token" in str(err)


@pytest.mark.parametrize("value", [101, -1, 10**6, 2.0])
def test_top_logprobs_num_beyond_the_vocabulary(value):
    err = _rejected(GenerateFields(input_ids=[1, 2], top_logprobs_num=value, return_logprob=True))
    assert err.field == "top_logprobs_num" and "[0, 100]" in str(err)


@pytest.mark.parametrize("value", [3, 50, -2])
def test_logprob_start_len_beyond_the_input(value):
    err = _rejected(GenerateFields(input_ids=[1, 2, 3], logprob_start_len=value,
                                   return_logprob=True))
    assert err.field == "logprob_start_len" and "[-1, 2]" in str(err)


@pytest.mark.parametrize("fields", [
    GenerateFields(input_ids=[0, 99]),
    GenerateFields(input_ids=None, text="hi"),
    GenerateFields(input_ids=None, text=None),  # e.g. input_embeds: nothing to check here
    GenerateFields(input_ids=[1, 2, 3], top_logprobs_num=100, logprob_start_len=2, return_logprob=True),
    GenerateFields(input_ids=[1, 2, 3], logprob_start_len=-1, return_logprob=True),
    GenerateFields(input_ids=[1, 2, 3], logprob_start_len=99, return_logprob=False),  # ignored
])
def test_valid_requests_pass(fields):
    check_generate(fields, VOCAB)


def test_openai_top_logprobs_range():
    check_openai_top_logprobs("top_logprobs", 20)
    check_openai_top_logprobs("top_logprobs", None)
    with pytest.raises(RequestRejected, match=r"top_logprobs = 21 .*\[0, 20\]"):
        check_openai_top_logprobs("top_logprobs", 21)
    with pytest.raises(RequestRejected, match=r"logprobs = 6 .*\[0, 5\]"):
        check_openai_top_logprobs("logprobs", 6)


def test_parallel_sample_count():
    check_sampling_params({"n": 128})
    check_sampling_params([{"max_new_tokens": 2}, {"n": 1}])
    check_sampling_params(None)
    for bad in ({"n": 0}, [{"n": 2}, {"n": -2}], {"n": 1.5}, {"n": 49152}):
        with pytest.raises(RequestRejected, match=r"sampling_params.n = .* integer in \[1, 128\]"):
            check_sampling_params(bad)
