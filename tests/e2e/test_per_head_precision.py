"""Per-head precision end to end (--ragged-precision mixed, docs/architecture.md, "Row tiers"): a
profile whose KV heads keep their low tiers in int8, int4 and int2 is served with exactly the
bytes its layout predicts, multi-turn traffic reads its sealed pages back with the pool's
integrity check after every forward, and a --ragged-precision that disagrees with the profile
stops the launch with a message saying what to pass."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.tiers import compose
from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.profile import BudgetProfile, ProfileTiers, uniform_profile
from tests.e2e.conftest import COMMON, _start
from tests.e2e.test_bad_inputs import _launch_error
from tests.e2e.test_precision import assert_capacity, assert_second_turn_reads_sealed_pages

pytestmark = pytest.mark.e2e

RATIO = 0.3
MAX_TOKENS = 16384


def mixed_profile() -> BudgetProfile:
    """uniform:0.3 of SmolLM2 (30 layers, 3 KV heads) with one group per head, each head's
    format cycling int8, int4, int2 and its composition the default rule of that format."""
    base = uniform_profile(RATIO, 30, 3, 1)
    slots = base.slots_per_group(64, min_slots=4)
    names = itertools.cycle(("int8", "int4", "int2"))
    hi, lo, fmts = ([[0.0] * 3 for _ in range(30)], [[0.0] * 3 for _ in range(30)],
                    [["int4"] * 3 for _ in range(30)])
    for li in range(30):
        for h in range(3):
            name = next(names)
            t = compose(slots[li][h], 64, 64, 2, LOW_PRECISIONS[name], 4)
            hi[li][h], lo[li][h], fmts[li][h] = t.hi / 64, t.lo / 64, name
    return BudgetProfile(base.model, base.budgets, base.groups, base.source,
                         tiers=ProfileTiers("mixed", hi, lo, fmts))


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixed") / "mixed-uniform-rho0.3.json"
    mixed_profile().save(path)
    return path


def test_a_precision_that_disagrees_with_the_profile_is_refused(model_path, profile_path):
    log = _launch_error(model_path, ["--ragged-profile", str(profile_path), "--ragged-precision", "int4"])
    assert "stores a low precision per head (tiers.precision mixed); serve it with --ragged-precision mixed, not int4" in log  # before the module's server starts: one server at a time


@pytest.fixture(scope="module")
def mixed_server(request: pytest.FixtureRequest, model_path: str, profile_path: Path):
    return _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                            "--ragged-profile", str(profile_path), "--ragged-precision", "mixed",
                            "--max-total-tokens", str(MAX_TOKENS), "--max-running-requests", "4",
                            "--enable-metrics"], "precision-mixed")


def test_capacity_is_what_the_mixed_layout_predicts(mixed_server, profile_path):
    layout = RaggedLayout.from_profile(BudgetProfile.load(profile_path), 64, 64, 2, "mixed")
    drop_only = RaggedLayout.from_profile(uniform_profile(RATIO, 30, 3, 1), 64, 64, 2)
    assert layout.mixed_formats and layout.row_bytes_per_page <= drop_only.row_bytes_per_page
    assert_capacity(mixed_server, layout, MAX_TOKENS, "mixed", "none")
    # auto on a CPU: the native kernels read each group's format (Triton reads one per launch)
    assert "ragged attention: NativeAttention (--ragged-attention auto)" in mixed_server.log_text()


def test_multi_turn_reads_mixed_format_history(mixed_server):
    assert_second_turn_reads_sealed_pages(mixed_server.base_url)
