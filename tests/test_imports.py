"""kvlite's modules import each other one way: no cycles, counting imports inside functions too
(a deferred import is still a dependency), but not TYPE_CHECKING-only ones."""

from __future__ import annotations

import ast
import pathlib

import kvlite

PKG = pathlib.Path(kvlite.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = ["kvlite", *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The kvlite modules a file imports (from X import Y counts X.Y when that is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvlite")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("kvlite"):
                target = node.module
            else:
                continue
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
    return {m for m in out if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules) for f in files}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            # A module importing its own package's __init__ (or the reverse) is how Python packages
            # work, not a design cycle: the package is initialised first either way.
            if m.startswith(n + ".") or n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_graph_is_read():
    g = graph()
    assert "kvlite.runner" in g and "kvlite.policies" in g["kvlite.runner"]
    assert "kvlite.native" in g["kvlite.scoring.proposals"]


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_a_cycle_is_found():  # the checker itself can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_only_native_touches_the_library():
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if path.name != "native.py":
            assert "ctypes.data" not in text and "kvl_" not in text, f"{path} reaches into the C library"


def test_every_registered_policy_is_exported():
    """kvlite's policy exports come from the registry: a new policy needs no line in kvlite/__init__."""
    from kvlite.policies import POLICIES

    assert {cls.__name__ for cls in POLICIES.values()} <= set(kvlite.__all__)
    assert all(getattr(kvlite, cls.__name__) is cls for cls in POLICIES.values())
