"""bench.capacity's configurations: profiles at the model dtype and ragged targets with a
precision, and the physical limit of each layout (no server)."""

from __future__ import annotations

import pytest

from bench.capacity import physical_limit, targets_of
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE
from sgl_ragged.profile import uniform_profile


def test_targets_of_profiles_then_launches():
    assert [(t.profile, t.precision) for t in targets_of(None, None)] == [("uniform:0.3", "bf16")]
    targets = targets_of(["uniform:0.5"], ["ragged@int4:uniform:0.3", "ragged:x.json"])
    assert [(t.profile, t.precision) for t in targets] == [
        ("uniform:0.5", "bf16"), ("uniform:0.3", "int4"), ("x.json", "bf16")]


@pytest.mark.parametrize("spec", ["baseline", "baseline@fp8_e4m3",
                                  "router:2:cache_aware:ragged:uniform:0.3"])
def test_targets_of_refuses_what_is_not_one_ragged_server(spec):
    with pytest.raises(ValueError, match="single ragged servers"):
        targets_of(None, [spec])


def test_targets_of_refuses_an_unknown_precision():
    with pytest.raises(ValueError):
        targets_of(None, ["ragged@int5:uniform:0.3"])


def test_physical_limit_counts_the_precision(model_path):
    """Rows of a profile at another precision spend the same bytes on other slots: the limit is
    1 / retention of the layout at that precision (int4@0.3: 2 full + 62 int4 slots a page, a
    little under drop-only's 20 full slots), and the default per-head profile's is the x3.20
    its server logs."""
    drop = physical_limit("uniform:0.3", model_path)
    int4 = physical_limit("uniform:0.3", model_path, "int4")
    layout = RaggedLayout.from_profile(uniform_profile(0.3, 30, 3), 64, 64, 2, "int4")
    assert int4 == pytest.approx(1 / layout.retention)
    assert drop == pytest.approx(64 / 20) and int4 > drop
    assert physical_limit(str(DEFAULT_PROFILE), model_path, DEFAULT_PRECISION) == pytest.approx(
        3.20, abs=0.01)
