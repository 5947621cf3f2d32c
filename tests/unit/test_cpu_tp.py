"""compat/cpu_tp.py: CPU (gloo) process groups are built without PyNccl; others unchanged."""

from __future__ import annotations

from typing import Any

from sgl_ragged.compat.cpu_tp import init_model_parallel_group


def _record(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def test_gloo_groups_get_no_pynccl() -> None:
    _, kwargs = init_model_parallel_group(_record, [[0, 1]], 0, "gloo", group_name="tp")
    assert kwargs == {"group_name": "tp", "use_pynccl": False}
    _, kwargs = init_model_parallel_group(_record, [[0, 1]], 0, backend="gloo")
    assert kwargs["use_pynccl"] is False


def test_other_backends_are_left_alone() -> None:
    _, kwargs = init_model_parallel_group(_record, [[0, 1]], 0, "nccl", group_name="tp")
    assert "use_pynccl" not in kwargs
    args, _ = init_model_parallel_group(_record, [[0, 1]], 0, "nccl", True)
    assert args[3] is True


def test_a_gloo_group_never_gets_pynccl() -> None:
    args, kwargs = init_model_parallel_group(_record, [[0, 1]], 0, "gloo", True, group_name="tp")
    assert args == ([[0, 1]], 0, "gloo", False) and kwargs == {"group_name": "tp"}
    _, kwargs = init_model_parallel_group(_record, [[0, 1]], 0, "gloo", use_pynccl=True)
    assert kwargs["use_pynccl"] is False
