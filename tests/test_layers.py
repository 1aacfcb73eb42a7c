"""The package's imports go down DESIGN.md's layers: no cycle, and nothing below the interfaces
imports them.

Read from the source with `ast`, every import counted, the ones inside functions too (an
import deferred into a function still makes the module depend on what it imports); imports
under ``if TYPE_CHECKING:`` are left out, since they never run. ``from a.b import c`` counts as
an import of ``a.b.c`` where that is a module and of ``a.b`` otherwise; the parent packages
Python also initialises on the way are not counted (every module would depend on
``capopt/__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "capopt"

# The interfaces: they parse and print, and they may import anything below them (the package's
# own ``__init__`` is the public API). `capopt.gpu.monitor` is not among them: it samples NVML
# for the device tier as well as for the command line, a probe that validation uses.
REPORT = {"capopt.report", "capopt.report.text", "capopt.report.figures"}
INTERFACES = {"capopt", "capopt.__main__", "capopt.cli", "capopt.gpu.doctor"} | REPORT
# What nothing below the interfaces may import.
UPWARD = {"capopt.cli", "capopt.gpu.doctor"} | REPORT


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _owner(name: str) -> str | None:
    """The package module that ``name`` (a module or an attribute of one) lives in."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for body in node.body for n in ast.walk(body))
    return skip


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name) if name.split(".")[0] == "capopt" else None
            if owner and owner != module:
                found.add(owner)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def dangling_imports(module: str) -> list[str]:
    """Package imports of ``module`` that name no module of the package (a relative import
    left behind by a move: it fails only when it runs, and a caller may swallow the error)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = ".".join(package[:len(package) - node.level + 1]
                            + ([node.module] if node.module else []))
        elif (node.module or "").split(".")[0] == "capopt":
            base = node.module
        else:
            continue
        if base not in MODULES:
            out.append(f"line {node.lineno}: {base}")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_deferred_imports():
    # a check that could fail: the walker must find imports that only run inside functions,
    # or the cycle test below would pass on a package full of them
    assert any(t.startswith("capopt.search") for t in GRAPH["capopt"])  # `optimize`'s
    assert "capopt.validation.calibrate" in GRAPH["capopt.cli"]          # `cmd_calibrate`'s
    assert "capopt.search.optimize" in GRAPH["capopt.cli"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_every_package_import_names_a_module():
    assert {m: d for m in MODULES if (d := dangling_imports(m))} == {}


def test_nothing_below_the_interfaces_imports_them():
    wrong = {m: sorted(GRAPH[m] & UPWARD) for m in GRAPH
             if m not in INTERFACES and GRAPH[m] & UPWARD}
    assert wrong == {}


def test_the_cost_model_imports_no_search_validation_or_interface():
    above = ("capopt.search", "capopt.validation", *UPWARD)
    wrong = {m: sorted(t for t in GRAPH[m] if t.startswith(above))
             for m in GRAPH if m.startswith("capopt.cost")}
    assert all(not v for v in wrong.values()), wrong
