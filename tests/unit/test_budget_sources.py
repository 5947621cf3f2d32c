"""The budget-source registry and the typed source record: one row per source, JSON round trips,
and no comparison of source kinds outside the registry."""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_ragged.profile import BudgetProfile, ModelShape, ProfileError, resolve_profile
from sgl_ragged.scoring import make_scorer
from sgl_ragged.sources import (
    DEFAULT_SOURCE,
    MODEL_FREE_KINDS,
    SOURCES,
    ModelFreeKind,
    SourceRecord,
    make_source,
    margin_sources,
    source_of,
)
from sgl_ragged.sources.config import CalibrationConfig

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ModelShape("LlamaForCausalLM", num_layers=2, num_kv_heads=2, head_dim=8)

# One row per registered source: name, record kind, default file prefix, Eq. 5 margin budgets.
ROWS = [
    ("tangram", "calibrated", "", True),
    ("kvcompose", "calibrated", "kvcompose-", True),
    ("baklava", "baklava", "baklava-", False),
]


def test_registry_lists_exactly_the_sources() -> None:
    assert list(SOURCES) == [row[0] for row in ROWS]
    assert DEFAULT_SOURCE == "tangram"
    assert margin_sources() == [name for name, _, _, margin in ROWS if margin]
    with pytest.raises(ValueError, match="unknown budget source 'snapkv'"):
        make_source("snapkv")


def _record(name: str) -> SourceRecord:
    options = {"eval_samples": 1} if name == "baklava" else {}
    cfg = CalibrationConfig(model_path="/models/tiny", output="o.json", source=name,
                            samples=3, source_options=options)  # fmt: skip
    return make_source(name).record(cfg, make_scorer("snapkv"), 0.3, ["summary", "code", "code"],
                                    [1024, 1088, 1536])  # fmt: skip


@pytest.mark.parametrize(("name", "kind", "prefix", "margin"), ROWS)
def test_each_source_round_trips_its_record(name: str, kind: str, prefix: str, margin: bool,
                                            tmp_path: Path) -> None:  # fmt: skip
    source = make_source(name)
    assert (source.name, source.record_kind, source.output_prefix, source.margin) == (name, kind, prefix, margin)
    record = _record(name)
    assert record.kind == kind and record["method"] == name and record.rho == 0.3
    assert ("alpha" in record) is margin and record.scorer == "snapkv"
    # JSON round trip: the same object, the same key order; the registry knows who wrote it.
    text = json.dumps(record.to_json())
    again = SourceRecord.from_json(json.loads(text))
    assert again == record and json.dumps(again.to_json()) == text
    assert type(source_of(again)) is type(source)
    assert not again.fits_any_model and not again.is_dynamic
    # Through a profile file: the record is loaded typed and written back unchanged.
    profile = BudgetProfile(SHAPE, [[0.5, 0.5]] * 2, [[[0], [1]]] * 2, record)
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = BudgetProfile.load(path)
    assert isinstance(loaded.source, SourceRecord) and loaded.source == record
    assert json.loads(path.read_text())["source"] == record.to_json()
    assert source.describe(loaded.source).startswith(source.headline(loaded.source))


def test_each_source_adds_its_cli_options_without_clashes() -> None:
    parser = argparse.ArgumentParser()
    for cls in SOURCES.values():
        cls().add_cli_options(parser)
    args = parser.parse_args([])
    for cls in SOURCES.values():  # each source's options are its options_type's fields
        options = cls().options_from_args(args)
        assert cls.options_type(**options) == cls.options_type()  # at the CLI's defaults


def test_records_without_method_are_tangrams_and_model_free_records_have_no_source() -> None:
    legacy = SourceRecord.from_json({"kind": "calibrated", "scorer": "snapkv", "rho": 0.3})
    assert type(source_of(legacy)) is SOURCES["tangram"]
    assert source_of(SourceRecord("calibrated", {"method": "unknown"})) is None
    for kind in ModelFreeKind:
        record = SourceRecord.model_free(kind, 0.4)
        assert record.to_json() == {"kind": kind.value, "rho": 0.4} and record.fits_any_model
        assert record.is_dynamic is (kind is ModelFreeKind.DYNAMIC) and source_of(record) is None
    assert resolve_profile("dynamic:0.2", SHAPE).source.is_dynamic
    assert not resolve_profile("uniform:0.2", SHAPE).source.is_dynamic


def test_record_is_frozen_and_keeps_key_order() -> None:
    record = SourceRecord.from_json({"kind": "calibrated", "rho": 0.3, "alpha": 2.0})
    updated = record.updated({"alpha": 1.5, "budget_mode": "mean"})
    assert list(updated) == ["kind", "rho", "alpha", "budget_mode"] and updated["alpha"] == 1.5
    assert record["alpha"] == 2.0 and record == {"kind": "calibrated", "rho": 0.3, "alpha": 2.0}
    with pytest.raises(TypeError):
        record.params["rho"] = 0.5  # type: ignore[index]
    with pytest.raises(ProfileError, match="string 'kind'"):
        SourceRecord.from_json({"rho": 0.3})
    with pytest.raises(ProfileError, match="only \\['dynamic', 'uniform'\\] profiles fit any model"):
        BudgetProfile(None, [[0.5]], [[[0]]], {"kind": "calibrated"})


# ----- no comparison of source kinds outside the registry ----------------------------------

KIND_NAMES = set(SOURCES) | {cls.record_kind for cls in SOURCES.values()} | set(MODEL_FREE_KINDS)


def _strings(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _strings(element)


def kind_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) of every comparison (==, !=, in, ...) against a source name or kind."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            found += [(node.lineno, s) for op in operands for s in _strings(op) if s in KIND_NAMES]
        elif isinstance(node, ast.Match):
            found.append((node.lineno, "match statement"))
    return found


def test_the_scan_finds_kind_comparisons() -> None:
    code = ('if profile.source["kind"] == "dynamic":\n    pass\n'
            'x = cfg.source in ("kvcompose", "other")\ny = kind != "calibrated"\nz = a == "snapkv"\n')  # fmt: skip
    assert kind_comparisons(code) == [(1, "dynamic"), (3, "kvcompose"), (4, "calibrated")]


def test_no_source_kind_is_compared_outside_the_registry() -> None:
    registry = ROOT / "sgl_ragged" / "sources"
    files = [p for d in ("sgl_ragged", "bench") for p in sorted((ROOT / d).rglob("*.py"))
             if registry not in p.parents]  # fmt: skip
    assert len(files) > 50
    offenders = [f"{p.relative_to(ROOT)}:{line}: {name}"
                 for p in files for line, name in kind_comparisons(p.read_text(encoding="utf-8"))]  # fmt: skip
    assert offenders == [], "ask the source registry (sgl_ragged/sources) or the SourceRecord instead"
