"""The import graph: one way, and without a cycle, ``TYPE_CHECKING`` imports included.

ARCHITECTURE.md: ``proxy -> interceptors -> protocol`` and
``pipelines -> interceptors, protocol``; ``protocol`` imports nothing of ours,
``interceptors`` never imports ``proxy``, ``proxy`` never imports ``pipelines``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "interceptors", "proxy", "pipelines")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kiproxy", *parts])


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    found.update({f"kiproxy.{p.stem}": p for p in (ROOT / "kiproxy").glob("*.py")
                  if p.stem != "__init__"})
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every project module ``name`` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != "kiproxy":
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
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
    return found


def test_no_import_cycle_among_the_project_modules() -> None:
    assert _cycles(_graph()) == []


def test_the_graph_sees_type_checking_imports() -> None:
    # The connection names the generation only for type checking; the graph counts it.
    assert "kiproxy.proxy.generation" in _graph()["kiproxy.proxy.connection"]


def test_imports_go_one_way() -> None:
    def layer(module: str) -> str:
        return module.split(".")[1]

    allowed = {"protocol": {"protocol"}, "interceptors": {"interceptors", "protocol"},
               "proxy": {"proxy", "interceptors", "protocol"},
               "pipelines": {"pipelines", "interceptors", "protocol"}}
    wrong = sorted(f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                   if layer(src) in allowed and layer(dst) not in allowed[layer(src)])
    assert wrong == []


def test_a_cycle_is_found_when_there_is_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_built_in_interceptors_use_only_the_public_api() -> None:
    builtin = {name: deps for name, deps in _graph().items()
               if name.startswith("kiproxy.interceptors.builtin.")}
    assert builtin  # the walk found them
    wrong = sorted(f"{src} -> {dst}" for src, dsts in builtin.items() for dst in dsts
                   if not dst.startswith("kiproxy.interceptors"))
    assert wrong == []
