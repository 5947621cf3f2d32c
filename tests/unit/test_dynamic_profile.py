"""`--ragged-profile dynamic:<rho>`: the dynamic reference mode's profile and its errors."""

from __future__ import annotations

import pytest

from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import ModelShape, ProfileError, resolve_profile
from sgl_ragged.serving.runtime import build_setup

SHAPE = ModelShape(architecture="LlamaForCausalLM", num_layers=3, num_kv_heads=4, head_dim=16)


def test_dynamic_profile_keeps_full_pages_and_records_rho():
    profile = resolve_profile("dynamic:0.3", SHAPE, heads_per_group=2)
    assert profile.source == {"kind": "dynamic", "rho": 0.3}
    layout = RaggedLayout.from_profile(profile, 64, 16, 2)
    assert layout.retention == 1.0  # saves no memory: a reference, not a production mode
    assert _setup("dynamic:0.3").dynamic_rho == 0.3
    assert _setup("uniform:0.3").dynamic_rho is None


def _setup(spec: str):
    return build_setup(RaggedConfig(profile=spec), SHAPE, page_size=64, dtype_bytes=2,
                       max_running_requests=4, tp_size=1, tp_rank=0, attention_scale=0.25)


@pytest.mark.parametrize("spec", ["dynamic:", "dynamic:0", "dynamic:1.5", "dynamic:abc"])
def test_bad_dynamic_spec_says_how_to_fix(spec):
    with pytest.raises(ProfileError, match=r"dynamic:<rho>.*e\.g\. dynamic:0\.3"):
        resolve_profile(spec, SHAPE)
