"""An embedding model (`--is-embedding`) served by the ragged backend, held to transformers.

SGLang serves a causal LM with `--is-embedding` as its last token's final hidden state,
L2-normalized, on /v1/embeddings: prefill only, through the same extend path, sealing and
radix cache as generation. A tiny random-weight Llama in float32 at `uniform:1.0` (the rows are
the full cache) must give transformers' embeddings, for one prompt, a batch, token ids, and a
prompt sent again, whose sealed pages then come from the radix cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import save_tiny_llama
from tests.e2e.conftest import INTEGRITY_ENV

pytestmark = pytest.mark.e2e

TEXTS = ["hello world " * 3, "the quick brown fox jumps over the lazy dog. " * 9]  # 1 and 7 pages


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    model = save_tiny_llama(tmp_path_factory.mktemp("embed") / "llama")
    args = ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
            "--is-embedding", "--page-size", "64", "--chunked-prefill-size", "128",
            "--max-total-tokens", "2048", "--max-running-requests", "2",
            "--attention-backend", "ragged", "--ragged-profile", "uniform:1.0"]
    log = Path("/tmp/sgl-ragged-test-logs") / "embeddings.log"
    with ServerProcess(args, env=INTEGRITY_ENV, log_path=log, startup_timeout=900) as server:
        yield model, server


def _reference(model_path: Path, inputs: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(
            model.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1).tolist()
            for ids in inputs]


def _embed(server: ServerProcess, inputs: object) -> list[list[float]]:
    reply = requests.post(f"{server.base_url}/v1/embeddings",
                          json={"model": "tiny", "input": inputs}, timeout=300)
    assert reply.status_code == 200, reply.text
    return [item["embedding"] for item in sorted(reply.json()["data"],
                                                  key=lambda d: d["index"])]


def _ids(model_path: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)(text)["input_ids"]


def _assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert len(a) == len(b) == 64
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_embeddings_are_transformers_hidden_states(served) -> None:
    model, server = served
    ids = [_ids(model, text) for text in TEXTS]
    assert [len(i) > 64 * n for i, n in zip(ids, (0, 6), strict=True)] == [True, True]
    want = _reference(model, ids)
    _assert_close(_embed(server, TEXTS[0]), want[:1])
    _assert_close(_embed(server, TEXTS), want)  # a batch
    _assert_close(_embed(server, ids[1]), want[1:])  # token ids, the 7 pages now cached
    _assert_close(_embed(server, [*ids[1][:-1], 7]), _reference(model, [[*ids[1][:-1], 7]]))
