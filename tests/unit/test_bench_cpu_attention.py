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


def test_other_shapes_keep_the_budgets() -> None:
    """--head-dim replaces the model's head size only; --gqa sizes the queries of a case."""
    default = cpu_attention.load_profile("uniform:0.3")
    wide = cpu_attention.load_profile("uniform:0.3", head_dim=128)
    assert wide.model.head_dim == 128 and default.model.head_dim == 64
    assert wide.budgets == default.budgets and wide.model.num_kv_heads == default.model.num_kv_heads
    storage, plans, (q, k, v) = cpu_attention.build_case(wide, 2, 128, True, gqa=8)
    heads = wide.model.num_kv_heads
    assert q.shape == (2, 8 * heads, 128) and k.shape == v.shape == (2, heads, 128)
    assert storage.layout.head_dim == 128 and len(plans) == 2


@pytest.mark.parametrize("args,message", [(["--gqa", "0"], "--gqa 0"),
                                          (["--head-dim", "100"], "--head-dim 100")])
def test_bad_shapes_say_what_was_wrong(args: list[str], message: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["cpu_attention", "--native", "bf16", *args])
    with pytest.raises(SystemExit):
        cpu_attention.main()
    assert message in capsys.readouterr().err
