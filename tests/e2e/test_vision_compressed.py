"""Images on compressed rows: a tiny Qwen2-VL in float32 with an int4 tier, served by the
native kernels and by the per-request torch reference (`--ragged-attention reference`) side by
side, with the pool's integrity check after every forward.

tests/e2e/test_architectures.py holds the vision-language models to transformers on the full
cache. Here every token of an image's pages is sealed into int4 codes and attended on them:
by every decode step, and from the radix cache when the same image comes again under another
question. The budget is 11 float32 slots' worth a page (uniform:0.171875), which at int4 keeps
all 64 tokens as codes and none at full precision, so no token is chosen over another and the
two paths differ only in arithmetic. They must give the same greedy tokens, with
log-probabilities within 1e-4 (measured: 9e-6). At uniform:0.3 (11 full + 53 int4 slots a
page) the tokens were the same too, but one log-probability parted by 1.06e-2. Which 11 tokens
take the full-precision slots is decided by window scores, which each path sums in its own
order, and a near tie went the other way (session 46, checked by hand)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import save_tiny_model
from tests.e2e.conftest import INTEGRITY_ENV, started_together
from tests.e2e.test_architectures import _generate_with_image, _image, _image_prompt

pytestmark = pytest.mark.e2e

ARCH = "Qwen2VLForConditionalGeneration"
ATTENTION = ("native", "reference")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    model = save_tiny_model(tmp_path_factory.mktemp("vision") / ARCH, ARCH)
    log_dir = Path(os.environ.get("RAGGED_TEST_LOGS", "/tmp/sgl-ragged-test-logs"))
    made = {}
    for attention in ATTENTION:
        args = ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
                "--page-size", "64", "--chunked-prefill-size", "128",
                "--max-total-tokens", "2048", "--max-running-requests", "2",
                "--attention-backend", "ragged", "--ragged-profile", "uniform:0.171875",
                "--ragged-precision", "int4", "--ragged-attention", attention]
        made[attention] = ServerProcess(args, env=INTEGRITY_ENV, startup_timeout=900,
                                        log_path=log_dir / f"vision-int4-{attention}.log")
    with started_together(made) as up:
        yield dict(up)


def _answers(server: ServerProcess) -> list[dict[str, Any]]:
    first, other = _image(0)[1], _image(1)[1]
    return [_generate_with_image(server, _image_prompt(question), url)["meta_info"]
            for url, question in ((first, " what is in it?"),
                                  (first, " which colour is most common?"),
                                  (other, " what is in it?"))]


def test_compressed_image_rows_match_the_reference(servers: dict[str, ServerProcess]) -> None:
    assert "ragged attention: NativeAttention" in servers["native"].log_text()
    for server in servers.values():  # every token as codes: nothing chosen for full precision
        assert "int4: 0.0 full + 64.0 int4 slots per page" in server.log_text()
    native, reference = (_answers(servers[attention]) for attention in ATTENTION)
    for case, (got, want) in enumerate(zip(native, reference, strict=True)):
        assert [t for _, t, _ in got["output_token_logprobs"]] == \
            [t for _, t, _ in want["output_token_logprobs"]], case
        assert max(abs(a[0] - b[0]) for a, b in zip(
            got["output_token_logprobs"], want["output_token_logprobs"], strict=True)) < 1e-4
    for meta in (native, reference):
        # the same image again: the preamble's and the image's sealed pages, all codes
        assert meta[1]["cached_tokens"] >= 192
        assert meta[2]["cached_tokens"] < 67  # another image: at most the preamble's page
