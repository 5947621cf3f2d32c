"""No import circle among sgl_ragged's modules nor among its packages, and the layering the tree
shows (kernels/ independent of attention_backend/; emulator/ below sources/ below calibrate/).

The import graph is read statically (ast) from every .py file of the package: module-level and
function-level imports of sgl_ragged modules count. Between modules, imports under
`if TYPE_CHECKING:` do not count (they never run); between packages they do (a type named
across packages is a dependency all the same). A strongly connected component of more than one
node is a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "sgl_ragged"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE  # this checkout's package

KNOWN_CIRCLES: tuple[frozenset[str], ...] = ()
"""Circles tolerated for now (none): a new one fails the test."""


def module_name(path: Path, root: Path = ROOT, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, type_checking: bool = False) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement under node, skipping the bodies of `if TYPE_CHECKING:` unless
    `type_checking`."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports_of_stmt(stmt, type_checking)
            continue
        yield from _imports_of_stmt(child, type_checking)


def _imports_of_stmt(stmt: ast.AST, type_checking: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt
    else:
        yield from _imports(stmt, type_checking)


def imported_modules(source: str, name: str, is_package: bool, modules: set[str],
                     type_checking: bool = False) -> set[str]:
    """The modules of `modules` that module `name` imports (`from a import b` counts a.b when
    that is a module, else a); with `type_checking`, those under `if TYPE_CHECKING:` too."""
    found: set[str] = set()
    for stmt in _imports(ast.parse(source), type_checking):
        if isinstance(stmt, ast.Import):
            targets = [alias.name for alias in stmt.names]
        else:
            base = stmt.module or ""
            if stmt.level:  # relative: from the module's package, up level - 1
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (stmt.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in stmt.names]
        for target in targets:
            # `import a.b.c` imports a.b.c; keep the longest known module prefix.
            parts = target.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    found.add(candidate)
                    break
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE,
                 type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports (outside TYPE_CHECKING blocks unless
    `type_checking`)."""
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: imported_modules(path.read_text(), name, path.name == "__init__.py", modules,
                                   type_checking)
            for name, path in files.items()}


def package_of(module: str, package: str = PACKAGE) -> str:
    """The node a module belongs to in the package graph: its first-level subpackage
    (sgl_ragged.mem_pool.storage -> sgl_ragged.mem_pool), or itself at the top level."""
    return ".".join(module.split(".")[:2]) if module.startswith(f"{package}.") else module


def package_graph(graph: Mapping[str, Iterable[str]], package: str = PACKAGE,
                  ignore_imports_of: Iterable[str] = ()) -> dict[str, set[str]]:
    """First-level package -> the other first-level packages its modules import; the imports
    made by modules under `ignore_imports_of` (module names or their prefixes) are left out."""
    ignored = tuple(ignore_imports_of)
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if any(module == i or module.startswith(f"{i}.") for i in ignored):
            continue
        node = package_of(module, package)
        out.setdefault(node, set()).update(
            t for t in map(lambda m: package_of(m, package), targets) if t != node)
    return out


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_cycle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert circles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}}) == [["p", "q"], ["x", "y"]]


def test_imports_are_read_with_their_scope(tmp_path):
    """Function-level imports count, TYPE_CHECKING ones do not; relative and `from pkg import
    module` forms resolve to modules."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.b import B\n"
        "def f():\n    from pkg.sub import c\n    return c\n")
    (pkg / "b.py").write_text("import pkg.a\n")
    (pkg / "sub" / "c.py").write_text("from .. import b\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("from pkg.sub import c\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.c"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.b", "pkg.sub.d"}
    assert graph["pkg.sub.d"] == {"pkg.sub.c"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]]
    (pkg / "a.py").write_text("")  # cut a -> c: only c <-> d is left
    assert circles(import_graph(pkg, "pkg")) == [["pkg.sub.c", "pkg.sub.d"]]


def test_package_graph_collapses_modules_and_ignores_listed_importers():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": {"p.a.z", "p.c"}, "p.a.z": set(), "p.c": set()}
    assert package_graph(graph, "p") == {"p.a": {"p.b"}, "p.b": {"p.a", "p.c"}, "p.c": set()}
    assert circles(package_graph(graph, "p")) == [["p.a", "p.b"]]
    assert circles(package_graph(graph, "p", ignore_imports_of=["p.b"])) == []
    assert circles(package_graph(graph, "p", ignore_imports_of=["p.b.y"])) == []
    assert circles(package_graph(graph, "p", ignore_imports_of=["p.b.yy"])) == [["p.a", "p.b"]]


def test_no_import_circle_between_packages():
    """First-level packages (and top-level modules) form no circle, counting TYPE_CHECKING
    imports."""
    graph = package_graph(import_graph(type_checking=True))
    found = circles(graph)
    assert not found, "import circles between sgl_ragged's packages:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_emulator_below_sources_below_calibration():
    """emulator/ imports neither sources/ nor calibrate/; sources/ does not import calibrate/
    (TYPE_CHECKING imports included)."""
    graph = import_graph(type_checking=True)
    above = {"emulator": ("sources", "calibrate", "cli"), "sources": ("calibrate", "cli")}
    bad = {m: sorted(t for t in targets if package_of(t) in {f"{PACKAGE}.{a}" for a in above[low]})
           for low in above for m, targets in graph.items() if package_of(m) == f"{PACKAGE}.{low}"}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"upward imports: {bad}"


def test_no_import_circle_in_the_package():
    found = [c for c in circles(import_graph()) if frozenset(c) not in KNOWN_CIRCLES]
    assert not found, "import circles among sgl_ragged's modules:\n" + "\n".join(
        " <-> ".join(c) for c in found)


KNOWN_TYPE_CIRCLES: tuple[frozenset[str], ...] = (
    frozenset({f"{PACKAGE}.sources", *(f"{PACKAGE}.sources.{m}" for m in (
        "baklava", "base", "config", "kvcompose", "margin", "tangram"))}),
)
"""Circles that only TYPE_CHECKING imports close, tolerated for now: sources/ (its registry
in __init__ imports every source, which name package types back)."""


def test_no_import_circle_in_the_package_counting_type_checking_imports():
    """Not even for type hints do two modules import each other (storage.py and sealer.py
    did: the storage built a Sealer that held it)."""
    graph = import_graph(type_checking=True)
    storage, sealer = f"{PACKAGE}.mem_pool.storage", f"{PACKAGE}.mem_pool.sealer"
    assert storage not in graph[sealer], "sealer.py imports storage.py (the Sealer holds no storage)"
    found = [c for c in circles(graph) if frozenset(c) not in KNOWN_TYPE_CIRCLES]
    assert not found, "import circles among sgl_ragged's modules (TYPE_CHECKING included):\n" + (
        "\n".join(" <-> ".join(c) for c in found))


def test_kernels_import_nothing_from_the_attention_backend():
    graph = import_graph()
    bad = {m: sorted(t for t in targets if t.startswith(f"{PACKAGE}.attention_backend"))
           for m, targets in graph.items() if m.startswith(f"{PACKAGE}.kernels")}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"kernels/ imports attention_backend/: {bad}"


def test_the_plan_and_shared_ops_are_leaves():
    """plan.py and ops.py import nothing of the package (every implementation imports them),
    nor envs.py (compat/ and native/ both read settings through it)."""
    graph = import_graph()
    for leaf in ("attention_backend.plan", "attention_backend.ops", "envs"):
        assert graph[f"{PACKAGE}.{leaf}"] == set(), leaf


# ---- the core and its SGLang adapters (sgl_ragged/serving) ----------------------------------

CORE = ("mem_pool", "attention_backend", "kernels", "scoring", "profile", "budgets", "config",
        "tp", "guard")
"""Packages and modules that know nothing of SGLang: serving/ adapts them to it."""


def _module_level_imports(node: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported: not in function bodies, not
    under `if TYPE_CHECKING:` (class bodies run at import, so they count)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _module_level_imports_of_stmt(stmt)
            continue
        yield from _module_level_imports_of_stmt(child)


def _module_level_imports_of_stmt(stmt: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt
    elif not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        yield from _module_level_imports(stmt)


def sglang_imports_at_module_level(source: str) -> list[str]:
    """The `sglang` modules a source imports when it is imported."""
    found = []
    for stmt in _module_level_imports(ast.parse(source)):
        names = ([a.name for a in stmt.names] if isinstance(stmt, ast.Import)
                 else [stmt.module or ""] if not stmt.level else [])
        found += [n for n in names if n == "sglang" or n.startswith("sglang.")]
    return found


def test_module_level_import_reader():
    source = ("import torch\nfrom typing import TYPE_CHECKING\nimport sglang.srt.a\n"
              "if TYPE_CHECKING:\n    from sglang.srt.b import B\n"
              "try:\n    from sglang.srt.c import C\nexcept ImportError:\n    pass\n"
              "class K:\n    from sglang.srt.d import D\n"
              "    def f(self):\n        from sglang.srt.e import E\n"
              "def g():\n    import sglang\n")
    assert sglang_imports_at_module_level(source) == ["sglang.srt.a", "sglang.srt.c", "sglang.srt.d"]


def test_the_core_imports_neither_sglang_nor_serving():
    """The core imports no sglang module at module level and nothing of serving/ at all;
    serving/ may import the core."""
    graph = import_graph()
    core = [f"{PACKAGE}.{name}" for name in CORE]

    def in_core(module: str) -> bool:
        return any(module == c or module.startswith(f"{c}.") for c in core)

    upward = {m: sorted(t for t in targets if t.startswith(f"{PACKAGE}.serving"))
              for m, targets in graph.items() if in_core(m)}
    assert not {m: t for m, t in upward.items() if t}, f"the core imports serving/: {upward}"
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    assert all(any(m == c or m.startswith(f"{c}.") for m in files) for c in core), core
    sglang = {m: sglang_imports_at_module_level(p.read_text()) for m, p in files.items() if in_core(m)}
    sglang = {m: s for m, s in sglang.items() if s}
    assert not sglang, f"the core imports SGLang at module level: {sglang}"
