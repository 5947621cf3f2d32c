"""Row tiers end to end (--ragged-precision, docs/architecture.md, "Row tiers"): the server reserves exactly
the bytes the tiered layout predicts at each low precision, serves multi-turn traffic from
quantized sealed pages with the pool's integrity check after every forward, and with every
sealed token in int8 stays within a tight tolerance of stock torch_native in float32, its rows
stored as computed or rotated (--ragged-rotation hadamard); a per-head profile searched for
rotated rows is served rotated without a flag (--ragged-rotation auto)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import BudgetProfile, uniform_profile
from sgl_ragged.testing.server import ServerProcess
from tests.e2e.conftest import COMMON, _start, get, post
from tests.e2e.test_bad_inputs import _launch_error
from tests.e2e.test_equivalence import PROMPTS, _greedy
from tests.e2e.test_serving import FACTS

pytestmark = pytest.mark.e2e

RATIO = 0.3
# In float32 a page of every token in int8 costs 17 full-precision slots of 64: at this budget
# the default composition keeps every token, all of them int8 (none upgraded, none dropped).
ALL_INT8_F32 = 17 / 64
MAX_TOKENS = 16384  # an explicit pool cap: the memory profiling of a busy machine varies
INT8_MAX_TOKENS = 8192  # the every-token int8 servers', as the oracle pair's
# A per-head profile searched for rotated rows (tiers.rotation hadamard): served without
# --ragged-precision or --ragged-rotation, both auto
ROTATED_PROFILE = Path(__file__).parents[2] / "calib_profiles/smollm2-135m-instruct/mixedr-uniform-rho0.3.json"


def _layout(precision: str, ratio: float, dtype_bytes: int,
            profile: BudgetProfile | None = None) -> RaggedLayout:
    profile = profile or uniform_profile(ratio, 30, 3)
    return RaggedLayout.from_profile(profile, 64, 64, dtype_bytes, precision)


# Each low format is served somewhere: int4, fp8 and the pairs here, int8 by the every-token
# int8 servers below (their capacity too), int2, int4 and int8 groups by the default per-head
# profile (the shared server; its capacity in test_per_head_precision.py). Session 51 dropped
# the uniform int8 and int2 servers of this fixture: a server start is about 90 s of CPU, and a
# clean-clone CI on a 2-core Zen 1 had taken 84 of its 90 minutes.
@pytest.fixture(scope="module", params=["int4", "fp8", "int8+int4", "fp8+int4", "mixedr-auto"])
def tiered_server(request: pytest.FixtureRequest, model_path: str):
    """uniform:0.3 at a precision (rows as computed), or the rotated per-head profile with
    precision and rotation auto (mixed, hadamard): the rotation changes the rows' values,
    never their bytes."""
    if request.param == "mixedr-auto":
        flags = ["--ragged-profile", str(ROTATED_PROFILE)]
        precision, rotation, profile = "mixed", "hadamard", BudgetProfile.load(ROTATED_PROFILE)
    else:
        precision, rotation, profile = request.param, "none", None
        flags = ["--ragged-profile", f"uniform:{RATIO}", "--ragged-precision", precision]
    server = _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                              *flags, "--max-total-tokens", str(MAX_TOKENS),
                              "--max-running-requests", "4", "--enable-metrics"],
                    f"precision-{request.param}")
    server.precision, server.rotation, server.profile = precision, rotation, profile
    return server


def assert_capacity(server: ServerProcess, layout: RaggedLayout, max_tokens: int,
                    precision: str, rotation: str) -> None:
    """The server reserved the layout's bytes per logical token and said so once."""
    log = server.log_text()
    cells = re.findall(r"ragged capacity: (\d+) bytes per logical token", log)
    assert cells == [str(-(-layout.row_bytes_per_page // 64))]
    pages = int(re.search(r"ragged capacity: (\d+) logical pages", log).group(1))
    info = json.loads(get(server.base_url, "/get_server_info"))
    assert info["max_total_num_tokens"] == min(pages * 64, max_tokens)
    assert f"retention {layout.retention:.3f}; {layout.describe_tiers()}" in log
    assert f"precision {precision}, rotation {rotation}," in log


def test_capacity_is_what_the_tiered_layout_predicts(tiered_server):
    layout = _layout(tiered_server.precision, RATIO, 2, tiered_server.profile)  # bf16
    drop_only = _layout("bf16", RATIO, 2)
    assert layout.quantized and layout.row_bytes_per_page <= drop_only.row_bytes_per_page
    assert_capacity(tiered_server, layout, MAX_TOKENS, tiered_server.precision,
                    tiered_server.rotation)


def assert_second_turn_reads_sealed_pages(base_url: str) -> None:
    """Turn 2 re-uses turn 1's sealed pages through the radix cache, and pages were sealed."""
    question = FACTS + "\nQuestion: what is the code of item 3? Answer:"
    first = post(base_url, "/generate", {
        "text": question, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    second = post(base_url, "/generate", {
        "text": question + first["text"] + "\nQuestion: and of item 5? Answer:",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert second["meta_info"]["cached_tokens"] >= 256  # whole sealed pages came back
    metrics = get(base_url, "/metrics").replace(":", "_")
    sealed = re.search(r"^sglang_ragged_pages_sealed_total(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    assert sealed and float(sealed.group(1)) >= 4


def test_multi_turn_reads_quantized_history(tiered_server):
    """Turn 2 re-uses turn 1's sealed (quantized) pages through the radix cache (answer
    quality at each precision is bench.accuracy's: docs/results.md)."""
    assert_second_turn_reads_sealed_pages(tiered_server.base_url)


@pytest.fixture(scope="module", params=["none", "hadamard"])
def int8_server(request: pytest.FixtureRequest, model_path: str) -> ServerProcess:
    """float32, every sealed token int8 (see ALL_INT8_F32), same settings as the oracle pair,
    rows as computed or rotated (a rotation applied or undone wrongly anywhere breaks the
    outputs, not just their rounding). (At uniform:1.0 the budget buys every token at full
    precision, so the default composition keeps no int8 slot there and the oracle pair's
    uniform:1.0 test already covers it.)"""
    f32 = ["--model-path", model_path, *COMMON, "--dtype", "float32", "--max-total-tokens",
           str(INT8_MAX_TOKENS), "--max-running-requests", "4", "--disable-radix-cache"]
    server = _start(request, [*f32, "--attention-backend", "ragged", "--ragged-profile",
                              f"uniform:{ALL_INT8_F32}", "--ragged-precision", "int8",
                              "--ragged-rotation", request.param], f"oracle-int8-{request.param}")
    server.rotation = request.param
    return server


def test_every_token_int8_capacity_is_what_the_layout_predicts(int8_server):
    layout = _layout("int8", ALL_INT8_F32, 4)  # float32: every token kept, all of them int8
    assert_capacity(int8_server, layout, INT8_MAX_TOKENS, "int8", int8_server.rotation)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked"])
def test_every_token_int8_stays_close_to_torch_native(int8_server, oracle_pair, prompt):
    layout = _layout("int8", ALL_INT8_F32, 4)
    assert {(t.hi, t.lo) for layer in layout.tiers for t in layer} == {(0, 64)}
    ids_q, lp_q = _greedy(int8_server.base_url, prompt)
    ids_n, lp_n = _greedy(oracle_pair[1].base_url, prompt)
    same = next((i for i, (a, b) in enumerate(zip(ids_q, ids_n, strict=True)) if a != b), len(ids_n))
    assert same >= 48, f"greedy outputs diverge at token {same}"
    assert max(abs(a - b) for a, b in zip(lp_q[:same], lp_n[:same], strict=True)) < 0.02


def test_precision_with_the_dynamic_reference_is_refused(model_path):
    log = _launch_error(model_path, ["--ragged-profile", "dynamic:0.3", "--ragged-precision", "int4"])
    assert "--ragged-precision int4 cannot be combined with the dynamic reference mode" in log


def test_rotation_of_rows_without_a_low_tier_is_refused(model_path):
    log = _launch_error(model_path, ["--ragged-profile", "uniform:0.3", "--ragged-rotation", "hadamard"])
    assert "--ragged-rotation hadamard rotates rows so that their quantized tiers lose less, but " \
           "--ragged-precision bf16 keeps none" in log


def test_unknown_precision_is_refused(model_path):
    log = _launch_error(model_path, ["--ragged-profile", "uniform:0.3", "--ragged-precision", "int3"])
    assert "--ragged-precision 'int3' is unknown; choose one of ['bf16', 'int8', 'int4', 'int2', 'fp8']" in log


def test_bad_pairs_are_refused_by_name(model_path):
    """(Paths that cannot read a quantized high tier refuse it: tests/unit/test_high_tier.py.)"""
    log = _launch_error(model_path, ["--ragged-profile", "uniform:0.5", "--ragged-precision", "int4+int2"])
    assert "--ragged-precision 'int4+int2' is unknown; a pair is <high>+<low>" in log
