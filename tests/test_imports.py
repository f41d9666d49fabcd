"""The import graph: no module imports itself back through others, and no package does (README: arrows only
point down). Every import counts: module level, inside functions, and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import hybridkv

ROOT = Path(hybridkv.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _arrows(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the hybridkv modules it imports (``from a import b`` imports ``a``, and ``a.b`` when a module)."""
    arrows: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridkv"):
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            arrows[name] |= {t for t in targets if t in modules and t != name}
    return arrows


def _circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in arrows.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in arrows:
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _between_packages(arrows: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in arrows.items():
        out.setdefault(_package(a), set()).update(_package(b) for b in targets if _package(b) != _package(a))
    return out


def _shown(circles: Iterable[list[str]]) -> str:
    return "; ".join(" <-> ".join(c) for c in circles)


def test_no_module_imports_itself_back() -> None:
    circles = _circles(_arrows(_modules()))
    assert not circles, f"import circles (name what one side reads with a Protocol, or move it): {_shown(circles)}"


def test_packages_import_only_downwards() -> None:
    circles = _circles(_between_packages(_arrows(_modules())))
    assert not circles, f"packages importing each other: {_shown(circles)}"


def test_the_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
