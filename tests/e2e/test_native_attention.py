"""The native CPU kernels end to end: float32 servers with `--ragged-attention native` and
`--ragged-attention reference` (the per-request torch oracle) on compressed rows (uniform:0.3:
sealed pages are read by every step), drop-only and with an int4 low tier, give the same greedy
output, with the pool's integrity check after every forward (conftest.INTEGRITY_ENV). The two
servers of a case run one after the other (one server at a time on a small machine).
Logprobs agree within 1e-3 (the oracle's tolerance) on drop-only rows; on int4 tiers within
5e-3: the kernels attend on the codes (q (.) s) . code + q . z, the reference on dequantized
rows q . (code s + z), so float32 sums round differently through 30 layers and sealing
(measured: 1.1e-3 on the chunked prompt, identical tokens)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import COMMON, _start
from tests.e2e.test_equivalence import PROMPTS, _greedy

pytestmark = pytest.mark.e2e


def _outputs(request: pytest.FixtureRequest, model_path: str, attention: str, precision: str
             ) -> list[tuple[list[int], list[float]]]:
    args = ["--model-path", model_path, *COMMON, "--dtype", "float32", "--max-total-tokens",
            "8192", "--max-running-requests", "4", "--disable-radix-cache",
            "--attention-backend", "ragged", "--ragged-profile", "uniform:0.3",
            "--ragged-precision", precision, "--ragged-attention", attention]
    server = _start(request, args, f"native-e2e-{attention}-{precision}")
    try:
        impl = {"native": "NativeAttention", "reference": "TorchAttention"}[attention]
        assert f"ragged attention: {impl} (--ragged-attention {attention})" in server.log_text()
        return [_greedy(server.base_url, prompt) for prompt in PROMPTS]
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["bf16", "int4"])
def native_and_reference(request: pytest.FixtureRequest, model_path: str):
    native = _outputs(request, model_path, "native", request.param)
    reference = _outputs(request, model_path, "reference", request.param)
    return native, reference, request.param


@pytest.mark.parametrize("prompt", range(len(PROMPTS)), ids=["short", "chunked"])
def test_native_matches_the_reference_path(native_and_reference, prompt):
    native, reference, precision = native_and_reference
    ids_n, lp_n = native[prompt]
    ids_r, lp_r = reference[prompt]
    assert ids_n == ids_r
    tolerance = {"bf16": 1e-3, "int4": 5e-3}[precision]
    assert max(abs(a - b) for a, b in zip(lp_n, lp_r, strict=True)) < tolerance
