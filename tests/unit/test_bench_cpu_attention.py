"""bench.cpu_attention's profiles: a file, or uniform:<ratio> on the default profile's model."""

from __future__ import annotations

import pytest

from bench import cpu_attention
from sgl_ragged.profile import BudgetProfile
from sgl_ragged.profile.validation import ProfileError


def test_uniform_takes_the_default_profiles_model() -> None:
    default = BudgetProfile.load(cpu_attention.REPO / cpu_attention.DEFAULT_PROFILE)
    uniform = cpu_attention.load_profile("uniform:0.3")
    assert uniform.model == default.model
    assert {b for layer in uniform.budgets for b in layer} == {0.3}
    assert cpu_attention.load_profile(str(cpu_attention.REPO / cpu_attention.DEFAULT_PROFILE)) == default


@pytest.mark.parametrize("spec", ["uniform:2", "no/such/profile.json"])
def test_bad_profiles_say_what_was_wrong(spec: str) -> None:
    with pytest.raises(ProfileError, match="uniform|does not exist"):
        cpu_attention.load_profile(spec)
