"""offbeat.core's modules import each other without a cycle: every import, at module level
or inside a function (a function-level import only hides a cycle until it runs), read
from the source with ast. A cycle means two modules share something that belongs to a
third, or to one of them: move it there."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in (SRC / "offbeat" / "core").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        if pkg:
            parts.pop()
        out[".".join(parts)] = (path, pkg)
    return out


def graph() -> dict[str, set[str]]:
    """module -> the offbeat.core modules it imports (`from pkg import sub` imports
    `pkg.sub`; the implicit import of a parent package is not an edge)."""
    mods = modules()
    g: dict[str, set[str]] = {}
    for name, (path, pkg) in mods.items():
        base = name.split(".") if pkg else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    prefix = base[: len(base) - node.level + 1]
                    target = ".".join(prefix + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = {f"{target}.{a.name}" for a in node.names} & set(mods)
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(target)
        g[name] = {d for d in deps if d in mods and d != name}
    return g


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_function_level_imports_and_finds_a_cycle():
    src = "def f():\n    from offbeat.core.b import x\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_offbeat_core_has_no_import_cycle():
    g = graph()
    assert "offbeat.core.trainer.job" in g and len(g) > 100
    found = cycles(g)
    assert not found, "import cycles in offbeat.core: " + "; ".join(
        " <-> ".join(sorted(c)) for c in found
    )
