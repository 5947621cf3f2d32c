"""The suite's shards (tests/conftest.py, scripts/test.sh): every test file in exactly one, the
modules that share a session-scoped server in one shard, and RAGGED_TEST_SHARD selecting
exactly its shard's tests."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import (
    E2E_B_MODULES,
    SESSION_SERVERS,
    SHARD_ENV,
    SHARDS,
    UNIT_B_MODULES,
    pytest_collection_modifyitems,
    shard_of,
)

TESTS = Path(__file__).resolve().parents[1]


def _session_fixtures() -> set[str]:
    """Names of the session-scoped fixtures tests/e2e/conftest.py defines."""
    tree = ast.parse((TESTS / "e2e" / "conftest.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and any(
                        kw.arg == "scope" and getattr(kw.value, "value", None) == "session"
                        for kw in dec.keywords)):
                    names.add(node.name)
    return names - {"model_path"}  # a path, not a server


def test_every_named_module_exists():
    for folder, names in (("e2e", E2E_B_MODULES), ("unit", UNIT_B_MODULES)):
        there = {p.name for p in (TESTS / folder).glob("test_*.py")}
        assert set(names) <= there, set(names) - there


def test_each_shared_server_is_used_from_one_shard():
    fixtures = _session_fixtures()
    assert fixtures == set(SESSION_SERVERS)  # the ones the hook runs last
    for name in fixtures:
        users = [p for p in (TESTS / "e2e").glob("test_*.py") if name in p.read_text()]
        assert users, name
        assert len({shard_of(p) for p in users}) == 1, (name, {p.name: shard_of(p) for p in users})


def test_files_map_to_their_shards():
    assert shard_of(TESTS / "unit" / "test_quant.py") == "unit-a"
    assert shard_of(TESTS / "unit" / "test_kernels_attention.py") == "unit-b"
    assert shard_of(TESTS / "e2e" / "test_serving.py") == "e2e-a"
    assert shard_of(TESTS / "e2e" / "test_precision.py") == "e2e-b"
    assert {shard_of(p) for p in (TESTS / "e2e").glob("test_*.py")} == {"e2e-a", "e2e-b"}


def _items(*names: str, shared: tuple[str, ...] = ()) -> list[SimpleNamespace]:
    """Stand-ins for collected tests: what the hook reads (path, fixturenames)."""
    return [SimpleNamespace(path=TESTS / name, name=name,
                            fixturenames=["ragged_server"] if name in shared else ["model_path"])
            for name in names]


def _select(shard: str, items: list[SimpleNamespace]) -> tuple[list[str], list[str]]:
    deselected: list[str] = []
    config = SimpleNamespace(hook=SimpleNamespace(
        pytest_deselected=lambda items: deselected.extend(item.name for item in items)))
    with pytest.MonkeyPatch.context() as mp:  # the shard this test itself runs in is kept
        mp.setenv(SHARD_ENV, shard)
        pytest_collection_modifyitems(config, items)
    return [item.name for item in items], deselected


def test_the_environment_selects_one_shard_in_order():
    names = ("unit/test_quant.py", "unit/test_kernels_aot.py", "e2e/test_fuzz.py",
             "e2e/test_fuzz.py", "e2e/test_readme_server.py", "e2e/test_precision.py")
    for shard in SHARDS:
        kept, dropped = _select(shard, items := _items(*names, shared=("e2e/test_fuzz.py",)))
        assert kept and all(shard_of(TESTS / n) == shard for n in kept)
        assert sorted(kept + dropped) == sorted(names)
        assert len(items) == len(kept)
    # the shared ragged_server's module after the one with its own server, its tests together
    assert _select("e2e-a", _items(*names, shared=("e2e/test_fuzz.py",)))[0] == [
        "e2e/test_readme_server.py", "e2e/test_fuzz.py", "e2e/test_fuzz.py"]
    kept, dropped = _select("unit-a", _items(*names))
    assert kept == ["unit/test_quant.py"] and len(dropped) == 5


def test_an_unknown_shard_is_refused_and_none_keeps_everything():
    with pytest.raises(pytest.UsageError, match=f"{SHARD_ENV}=gpu is not a shard"):
        _select("gpu", _items("unit/test_quant.py"))
    items = _items("unit/test_quant.py", "e2e/test_fuzz.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SHARD_ENV, raising=False)
        pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [item.name for item in items] == ["unit/test_quant.py", "e2e/test_fuzz.py"]
