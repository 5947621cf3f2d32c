"""bench.gpu_serve off the GPU: its prompts, its table, and a clean exit without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench import gpu_serve


def test_prompts_are_reproducible_and_in_range() -> None:
    a, b = gpu_serve.prompts(5, 3, 20, 40), gpu_serve.prompts(5, 3, 20, 40)
    assert a == b and len(a) == 5 and all(20 <= len(p) <= 40 for p in a)
    assert gpu_serve.prompts(5, 4, 20, 40) != a


def test_markdown_reports_each_server_and_the_match() -> None:
    rows = [{"name": "graphs and overlap on", "startup_s": 61.2, "round1_s": 1.5, "round2_s": 2.0,
             "tracebacks": 0},
            {"name": "both off", "tracebacks": 1, "error": "server exited with code 1"}]
    report = {"device": "NVIDIA H200", "model": "/tmp/m", "profile": "uniform:0.3",
              "precision": "int4", "requests": 8, "max_new_tokens": 32, "servers": rows,
              "matching": 0, "same_outputs": False}
    table = gpu_serve.markdown(report)
    assert "| graphs and overlap on | 61 | 1.5 | 2.0 | 0 |  |" in table
    assert "| both off | 0 | 0.0 | 0.0 | 1 | server exited with code 1 |" in table
    assert "graphs and overlap on vs both off: False (0 of 16)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_exits_cleanly_without_cuda(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.gpu_serve", "--model", "m", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "needs a CUDA device" in done.stdout


def _steps(tokens: list[int], logprobs: list[float], seconds: list[tuple[int, float]]) -> dict:
    """An answer's steps: each step's top two are its token and `seconds[i]`."""
    return {"tokens": tokens, "logprobs": logprobs,
            "top2": [[(t, lp), s] for t, lp, s in zip(tokens, logprobs, seconds, strict=True)]}


def test_answers_that_part_at_a_near_tie_and_elsewhere() -> None:
    same = _steps([1, 2, 3], [-1.0, -2.0, -3.0], [(9, -1.5), (9, -2.5), (9, -3.5)])
    assert gpu_serve.parting(same, same) == {"same": True, "at": None, "near_tie": False,
                                             "drift": 0.0}
    # step 1: 2 (-2.00) over 7 (-2.01) in one server, 7 (-2.00) over 2 (-2.02) in the other
    a = _steps([1, 2, 3], [-1.0, -2.0, -3.0], [(9, -1.5), (7, -2.01), (9, -3.5)])
    b = _steps([1, 7, 4], [-1.001, -2.0, -3.0], [(9, -1.5), (2, -2.02), (9, -3.5)])
    got = gpu_serve.parting(a, b)
    assert got["at"] == 1 and got["near_tie"] and got["drift"] == pytest.approx(0.001)
    assert got["gaps"] == [pytest.approx(0.01), pytest.approx(0.02)]
    far = _steps([1, 7, 4], [-1.0, -0.5, -3.0], [(9, -1.5), (2, -2.5), (9, -3.5)])
    assert not gpu_serve.parting(a, far)["near_tie"]  # the other server's gap is 2 nats
    other = _steps([1, 8, 4], [-1.0, -2.0, -3.0], [(9, -1.5), (5, -2.01), (9, -3.5)])
    assert not gpu_serve.parting(a, other)["near_tie"]  # neither token the other's second
    short = _steps([1, 2], [-1.0, -2.0], [(9, -1.5), (7, -2.01)])
    assert gpu_serve.parting(same, short) == {"same": False, "at": 2, "near_tie": False,
                                              "drift": 0.0}


def test_round_two_is_compared_where_round_one_agreed() -> None:
    x = _steps([1, 2], [-1.0, -2.0], [(9, -1.5), (9, -2.5)])
    y = _steps([1, 5], [-1.0, -2.0], [(9, -1.5), (9, -2.5)])
    on = {"round1_steps": [x, x], "round2_steps": [x, x]}
    off = {"round1_steps": [x, y], "round2_steps": [x, y]}
    rows = gpu_serve.compare(on, off)
    assert [(r["round"], r["request"], r["same"]) for r in rows] == [(1, 0, True), (1, 1, False),
                                                                       (2, 0, True)]
    report = {"device": "NVIDIA H200", "model": "/tmp/m", "profile": "uniform:0.3",
              "precision": "int4", "requests": 2, "max_new_tokens": 2, "servers": [],
              "matching": 2, "same_outputs": False, "partings": rows}
    assert ("Compared answers: 3 (2 the same); parted at a near tie (top-two gap <= 0.05 nats in "
            "both): 0, elsewhere: 1") in gpu_serve.markdown(report)


def test_generate_asks_for_the_top_two(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = []

    def post(url: str, body: dict, timeout: float) -> dict:
        sent.append(body)
        return {"text": " ab", "meta_info": {
            "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]],
            "output_top_logprobs": [[[-0.5, 11, None], [-0.7, 3, None]],
                                    [[-0.25, 12, None], [-2.0, 4, None]]]}}

    monkeypatch.setattr(gpu_serve, "post", post)
    got = gpu_serve.generate("http://x", "hello", 2)
    assert sent[0]["return_logprob"] and sent[0]["top_logprobs_num"] == 2
    assert sent[0]["sampling_params"] == {"temperature": 0, "max_new_tokens": 2}
    assert got == {"text": " ab", "tokens": [11, 12], "logprobs": [-0.5, -0.25],
                   "top2": [[(11, -0.5), (3, -0.7)], [(12, -0.25), (4, -2.0)]]}
