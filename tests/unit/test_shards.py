"""The suite's shards (tests/conftest.py, scripts/test.sh): every test file in exactly one, the
modules that share a session-scoped server in one shard, and RAGGED_TEST_SHARD selecting
exactly its shard's tests."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import E2E_B_MODULES, SHARD_ENV, SHARDS, UNIT_B_MODULES, shard_of

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


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
    assert {"ragged_server", "oracle_pair"} <= fixtures
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


def _collected(shard: str, *paths: str) -> tuple[int, str]:
    env = {**os.environ, SHARD_ENV: shard}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *paths], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_environment_selects_one_shard():
    paths = ("tests/unit/test_shards.py", "tests/unit/test_kernels_aot.py",
             "tests/e2e/test_fuzz.py", "tests/e2e/test_readme_server.py",
             "tests/e2e/test_precision.py")
    for shard in SHARDS:
        rc, out = _collected(shard, *paths)
        order = [line.split("::")[0] for line in out.splitlines() if "::" in line]
        assert rc == 0, out
        assert order and {shard_of(ROOT / p) for p in order} == {shard}, (shard, order)
        if shard == "e2e-a":  # the shared ragged_server's module after the one with its own
            assert order.index("tests/e2e/test_fuzz.py") > order.index("tests/e2e/test_readme_server.py")
    rc, out = _collected("gpu", *paths)
    assert rc != 0 and f"{SHARD_ENV}=gpu is not a shard" in out
