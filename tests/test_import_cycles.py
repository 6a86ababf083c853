"""graphkiln's modules import one another without cycles (type-only imports aside).

A cycle between two modules means neither can be read, tested or moved without the other, and
it is usually hidden by a function-level import; so every import counts here, wherever it is in
the module, except those under ``if TYPE_CHECKING:`` (they never run). Parsed with ``ast``:
nothing is imported, so the test is fast and cannot be fooled by import order.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "graphkiln"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool):
    """Every import ``tree`` runs, as (module, names taken from it): absolute, relative ones
    resolved."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from ((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the graphkiln modules it imports (edges only to modules that exist)."""
    files = {_module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges = set()
        for base, names in _imports(tree, name, path.name == "__init__.py"):
            # ``from pkg import sub`` imports the submodule; the package's __init__ runs first, as it
            # does for any ``import pkg.sub``, which is no edge to it either (an __init__ that
            # imports its submodules must not make every sibling import a cycle)
            subs = {f"{base}.{n}" for n in names} & files.keys()
            edges |= subs if subs and len(subs) == len(names) else subs | {base}
        graph[name] = {m for m in edges if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    """The finder itself: a cycle closed by a function-level or relative import is found; one
    closed only under TYPE_CHECKING is not, nor a package whose __init__ re-exports a submodule
    that imports a sibling."""
    pkg = tmp_path / "graphkiln"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from graphkiln.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from graphkiln import a\n")
    (pkg / "sub" / "c.py").write_text("from . import d\n")
    (pkg / "sub" / "d.py").write_text("import graphkiln.sub.c\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nimport graphkiln.f\n")
    (pkg / "f.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from graphkiln import e\n")
    (pkg / "pkg").mkdir()
    (pkg / "pkg" / "__init__.py").write_text("from graphkiln.pkg.g import x\n")  # re-exports, as manifest/ does
    (pkg / "pkg" / "g.py").write_text("from graphkiln.pkg import h\n")  # a sibling: no edge to the __init__
    (pkg / "pkg" / "h.py").write_text("")
    assert cycles(import_graph(pkg)) == [["graphkiln.a", "graphkiln.b"], ["graphkiln.sub.c", "graphkiln.sub.d"]]


def test_graphkiln_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (move what both need below both): " + "; ".join(" <-> ".join(c) for c in found)
