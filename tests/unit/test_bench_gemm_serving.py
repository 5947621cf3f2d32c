"""bench.gemm_serving: rounds alternate over the servers (who goes first swaps) and the
concurrencies, medians after warm-up, the table's ratios against the first choice, and the
requests it sends (the servers themselves: a manual run)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench import gemm_serving


def test_rounds_alternate_and_medians_skip_the_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, int, int]] = []

    async def fake_round(base_url: str, c: int, max_tokens: int, seed: int) -> dict[str, Any]:
        order.append((base_url, c, seed))
        r = len(order)
        return {"tok_s": 1000.0 if r <= 4 else 10.0 * c + r, "tpot_s": 0.1 * r}

    monkeypatch.setattr(gemm_serving, "one_round", fake_round)
    out = gemm_serving.measure({"a": "url-a", "b": "url-b"}, [1, 8], 16, warmup=1, repeats=3)
    # every server in a round, who goes first swapping every round (session 33: a fixed order
    # biased a served A/B by up to 14%), the concurrencies in turn on each
    assert [(u, c) for u, c, _ in order] == (
        [("url-a", 1), ("url-a", 8), ("url-b", 1), ("url-b", 8)]
        + [("url-b", 1), ("url-b", 8), ("url-a", 1), ("url-a", 8)]) * 2
    seeds = [(u, seed) for u, _, seed in order]
    assert len({seed for _, seed in seeds}) == 8  # every round's prompts are new ...
    assert sorted(s for u, s in seeds if u == "url-a") == \
        sorted(s for u, s in seeds if u == "url-b")  # ... and the same on every server
    # rounds 2-4 (after the warm-up): url-a's 1-request rounds were calls 7, 9, 15
    assert out["a"][1] == {"tok_s": 10.0 + 9, "tpot_s": 0.1 * 9, "rounds": 3}
    assert out["b"][8]["tok_s"] == 80.0 + 12 and out["b"][8]["rounds"] == 3


def test_the_table_and_its_ratios() -> None:
    report = {"served": "ragged mixed:p.json", "max_tokens": 64, "repeats": 3,
              "concurrency": [1, 16],
              "choices": {"float32": {"1": {"tok_s": 4.0, "tpot_s": 0.25},
                                      "16": {"tok_s": 16.0, "tpot_s": 0.9}},
                          "auto": {"1": {"tok_s": 5.0, "tpot_s": 0.2},
                                   "16": {"tok_s": 40.0, "tpot_s": 0.4}}}}
    table = gemm_serving.markdown(report)
    assert "| 1 | 4.0 | 250 | 5.0 | 200 | x1.25 |" in table
    assert "| 16 | 16.0 | 900 | 40.0 | 400 | x2.50 |" in table
    assert "ratios against float32" in table


def test_configurations_pair_the_choices_with_the_ops() -> None:
    assert gemm_serving.configurations(["float32", "auto"], ["auto"]) == {
        "float32": {"RAGGED_CPU_GEMM": "float32", "RAGGED_CPU_OPS": "auto"},
        "auto": {"RAGGED_CPU_GEMM": "auto", "RAGGED_CPU_OPS": "auto"}}
    runs = gemm_serving.configurations(["auto"], ["torch", "auto"])
    assert list(runs) == ["auto ops=torch", "auto ops=auto"]
    assert runs["auto ops=torch"] == {"RAGGED_CPU_GEMM": "auto", "RAGGED_CPU_OPS": "torch"}


def test_each_request_runs_to_length_with_its_own_prompt() -> None:
    a, b = (gemm_serving._payload(7, i, 32) for i in (0, 1))
    assert a["min_tokens"] == a["max_tokens"] == 32 and a["temperature"] == 0 and a["stream"]
    assert a["messages"][0]["content"] != b["messages"][0]["content"]


@pytest.mark.parametrize(("rounds", "message"), [
    (lambda: gemm_serving.one_round("http://127.0.0.1:9", 2, 8, seed=0),
     r"2 of 2 requests failed: HTTP 500: boom"),
    (lambda: gemm_serving.prefill_round("http://127.0.0.1:9", 64, seed=0),
     r"the prefill request failed: HTTP 500: boom"),
], ids=["decode", "prefill"])
def test_a_failed_request_fails_the_round(rounds: Any, message: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing(http: Any, base_url: str, payload: Any, record: Any, t0: float) -> Any:
        record.error = "HTTP 500: boom"
        return record

    monkeypatch.setattr(gemm_serving, "stream_chat", failing)
    with pytest.raises(RuntimeError, match=message):
        asyncio.run(rounds())


def test_the_launch_is_the_readme_server_or_stock() -> None:
    import argparse

    args = argparse.Namespace(profile="p.json", precision="mixed", max_total_tokens=8192,
                              concurrency=[1, 16], page_size=64, chunked_prefill_size=4096)
    launch = gemm_serving.launch_args("/m", args)
    # scripts/serve.sh's pages and chunks (the bench served pages of 16 before session 34)
    assert launch[launch.index("--page-size") + 1] == "64"
    assert launch[launch.index("--chunked-prefill-size") + 1] == "4096"
    assert launch[launch.index("--attention-backend") + 1] == "ragged"
    assert launch[launch.index("--max-running-requests") + 1] == "16"
    assert "--enable-cache-report" in launch  # the prefill rounds' cached tokens
    args.profile = ""
    assert "torch_native" in gemm_serving.launch_args("/m", args)


def test_prefill_documents_are_distinct_from_the_first_words() -> None:
    a, b = gemm_serving.document(1, 600), gemm_serving.document(2, 600)
    assert a.split()[:2] != b.split()[:2]
    assert a == gemm_serving.document(1, 600)  # the same seed, the same document
    assert 500 <= len(a.split()) <= 600


def test_a_prefill_round_counts_only_the_tokens_it_prefilled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []

    async def fake(http: Any, base_url: str, payload: Any, record: Any, t0: float) -> Any:
        sent.append(payload)
        record.prompt_tokens, record.cached_tokens = 2100, 100
        record.first_token_at = record.start + 4.0
        return record

    monkeypatch.setattr(gemm_serving, "stream_chat", fake)
    out = gemm_serving.measure_prefill({"a": "url-a", "b": "url-b"}, 2048, warmup=1, repeats=2)
    assert out["a"] == out["b"] == {"prefill_tok_s": 500.0, "ttft_s": 4.0, "prompt_tokens": 2100,
                                    "cached_tokens": 100, "rounds": 2}
    prompts = [p["messages"][0]["content"] for p in sent]
    assert len(prompts) == 6 and len(set(prompts)) == 3  # a new document every round, the same
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # one on every server
    assert all(p["max_tokens"] == 2 for p in sent)


def test_prefill_rounds_take_turns_going_first(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    async def fake(base_url: str, tokens: int, seed: int) -> dict[str, Any]:
        seen.append(base_url)
        return {"prefill_tok_s": 1.0, "ttft_s": 1.0, "prompt_tokens": tokens, "cached_tokens": 0}

    monkeypatch.setattr(gemm_serving, "prefill_round", fake)
    gemm_serving.measure_prefill({"a": "url-a", "b": "url-b"}, 64, warmup=0, repeats=3)
    assert seen == ["url-a", "url-b", "url-b", "url-a", "url-a", "url-b"]


def test_the_prefill_table() -> None:
    decode = {"1": {"tok_s": 4.0, "tpot_s": 0.25}}
    report = {"served": "ragged mixed:p.json", "max_tokens": 64, "repeats": 3,
              "concurrency": [1],
              "choices": {"float32": {**decode, "prefill": {"prompt_tokens": 2051.0,
                                                            "cached_tokens": 30, "ttft_s": 4.0,
                                                            "prefill_tok_s": 505.0}},
                          "native": {**decode, "prefill": {"prompt_tokens": 2051.0,
                                                           "cached_tokens": 30, "ttft_s": 2.0,
                                                           "prefill_tok_s": 1010.0}}}}
    table = gemm_serving.markdown(report)
    assert "| float32 | 2051 | 30 | 4000 | 505 | x1.00 |" in table
    assert "| native | 2051 | 30 | 2000 | 1010 | x2.00 |" in table


def test_the_default_reference_is_what_auto_replaces() -> None:
    assert gemm_serving.default_choices(frozenset({"avx2", "avx512f", "avx512_bf16"})) == \
        ["bfloat16", "auto"]
    assert gemm_serving.default_choices(frozenset({"avx2", "amx_bf16"})) == ["bfloat16", "auto"]
    assert gemm_serving.default_choices(frozenset({"avx2", "fma", "avx512f"})) == ["float32", "auto"]
    assert gemm_serving.default_choices(frozenset()) == ["float32", "auto"]
