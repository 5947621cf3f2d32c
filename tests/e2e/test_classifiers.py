"""Sequence classifiers and reward models (config.SEQUENCE_CLASSIFIERS) served by the ragged
backend, held to transformers.

SGLang serves a `*ForSequenceClassification` checkpoint as an embedding model: its decoder runs
prefill only (through the same extend path, sealing and radix cache as generation) and the
score head reads the last token's hidden state; /v1/embeddings returns the scores. A tiny
random-weight Llama classifier in float32 at `uniform:1.0` (the rows are the
full cache) must give transformers' scores for a short prompt, one of seven pages, the same
again from the radix cache, and a batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sgl_ragged.config import SEQUENCE_CLASSIFIERS
from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import save_tiny_model
from tests.e2e.conftest import INTEGRITY_ENV, started_together

pytestmark = pytest.mark.e2e

TEXTS = ["a short review", "the quick brown fox jumps over the lazy dog. " * 9]  # 1 and 7 pages
ATOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, ServerProcess]]]:
    root = tmp_path_factory.mktemp("classifiers")
    models = {arch: save_tiny_model(root / arch, arch) for arch in SEQUENCE_CLASSIFIERS}
    logs = Path("/tmp/sgl-ragged-test-logs")
    servers = {arch: ServerProcess(
        ["--model-path", str(model), "--device", "cpu", "--dtype", "float32", "--is-embedding",
         "--page-size", "64", "--chunked-prefill-size", "128", "--max-total-tokens", "2048",
         "--max-running-requests", "2", "--attention-backend", "ragged",
         "--ragged-profile", "uniform:1.0"],
        env=INTEGRITY_ENV, log_path=logs / f"classifier-{arch}.log", startup_timeout=900)
        for arch, model in models.items()}
    with started_together(servers):
        yield {arch: (models[arch], servers[arch]) for arch in SEQUENCE_CLASSIFIERS}


def _reference(model_path: Path, ids: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([i])).logits[0].tolist() for i in ids]


def _scores(server: ServerProcess, inputs: object) -> list[list[float]]:
    reply = requests.post(f"{server.base_url}/v1/embeddings",
                          json={"model": "tiny", "input": inputs}, timeout=300)
    assert reply.status_code == 200, reply.text
    return [item["embedding"] for item in sorted(reply.json()["data"], key=lambda d: d["index"])]


def _assert_close(got: list[list[float]], want: list[list[float]], what: str) -> None:
    assert [len(g) for g in got] == [len(w) for w in want] == [2] * len(want), what
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert worst < ATOL, f"{what}: {worst}"


@pytest.mark.parametrize("arch", SEQUENCE_CLASSIFIERS)
def test_scores_are_transformers(served, arch: str) -> None:
    from transformers import AutoTokenizer

    model, server = served[arch]
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert len(ids[1]) > 6 * 64
    want = _reference(model, ids)
    _assert_close(_scores(server, TEXTS[0]), want[:1], f"{arch}, one page")
    _assert_close(_scores(server, ids[1]), want[1:], f"{arch}, seven pages")
    _assert_close(_scores(server, ids[1]), want[1:], f"{arch}, seven pages, cached")
    _assert_close(_scores(server, TEXTS), want, f"{arch}, a batch")
