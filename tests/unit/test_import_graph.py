"""The import graph: one way, and without a cycle, ``TYPE_CHECKING`` imports included.

ARCHITECTURE.md: ``proxy -> interceptors -> protocol`` and
``pipelines -> interceptors, protocol``; ``protocol`` imports nothing of ours,
``interceptors`` never imports ``proxy``, ``proxy`` never imports ``pipelines``.
Inside ``proxy`` the sub-packages keep the order :data:`PROXY_LAYERS` declares
(each package's ``__init__`` docstring says the same), and the local brokers of
``kiproxy dev`` (``kiproxy_dev``, the distribution in ``dev/``) are imported by no module
of ``kiproxy``: the command finds them through an entry point.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "interceptors", "proxy", "pipelines")
DEV = "kiproxy_dev"  # dev/kiproxy_dev: the second distribution, on top of the runtime

PROXY_LAYERS: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "observe": frozenset({"config"}),
    "admin": frozenset({"config", "observe"}),
    "reload": frozenset({"config"}),
    "isolation": frozenset({"observe"}),
    "routes": frozenset({"config", "observe", "isolation"}),
    "net": frozenset({"config", "observe", "routes"}),
    "brokers": frozenset({"config", "observe", "net"}),
    "produce": frozenset({"config", "observe", "isolation", "routes", "net", "brokers"}),
    "fetch": frozenset({"observe", "routes", "net", "produce"}),
}
"""Each sub-package of ``kiproxy.proxy`` and the others it may import. The modules
directly in ``proxy/`` (server, connection, dispatch, generation, cli) may import
every package; no package imports them."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kiproxy":
        parts.pop(0)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kiproxy", *parts])


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    # The Cython extensions are modules too (an import of one is not of its package).
    found.update({_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.pyx")})
    found.update({f"kiproxy.{p.stem}": p for p in (ROOT / "kiproxy").glob("*.py")
                  if p.stem != "__init__"})
    for p in (ROOT / "dev" / DEV).rglob("*.py"):
        parts = list(p.relative_to(ROOT / "dev").with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every project module ``name`` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":  # its Python import statements (not cimport), read as Python
        text = "\n".join(m[0] for m in re.findall(
            r"^((from\s+\S+\s+import\s+(\([^)]*\)|[^\n]*))|import\s+[^\n]*)$", text, re.M))
    for node in ast.walk(ast.parse(text)):
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
            if target and target != name and target not in ("kiproxy", DEV):
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
        return DEV if module.startswith(DEV) else module.split(".")[1]

    allowed = {"protocol": {"protocol"}, "interceptors": {"interceptors", "protocol"},
               "proxy": {"proxy", "interceptors", "protocol"},
               "pipelines": {"pipelines", "interceptors", "protocol"},
               DEV: {DEV, "proxy", "interceptors", "protocol"}}
    wrong = sorted(f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                   if layer(src) in allowed and layer(dst) not in allowed[layer(src)])
    assert wrong == []


def _proxy_package(module: str) -> str | None:
    """The sub-package of ``kiproxy.proxy`` that holds ``module``; None for the top."""
    parts = module.split(".")
    if parts[:2] != ["kiproxy", "proxy"] or len(parts) < 4:
        return None
    return parts[2]


def test_every_proxy_sub_package_has_a_declared_layer() -> None:
    found = {p.parent.name for p in (ROOT / "proxy").glob("*/__init__.py")}
    assert found == set(PROXY_LAYERS)


def test_the_declared_layers_have_no_cycle() -> None:
    assert _cycles({name: set(deps) for name, deps in PROXY_LAYERS.items()}) == []


def test_proxy_sub_packages_import_only_the_layers_below_them() -> None:
    wrong = []
    for src, dsts in _graph().items():
        if not src.startswith("kiproxy.proxy"):
            continue
        mine = _proxy_package(src)
        for dst in dsts:
            if not dst.startswith("kiproxy.proxy"):
                continue
            theirs = _proxy_package(dst)
            if mine is None or theirs == mine:
                continue  # the top imports anything; a package imports itself
            if theirs is None or theirs not in PROXY_LAYERS[mine]:
                wrong.append(f"{src} -> {dst}")
    assert sorted(wrong) == []


def test_the_runtime_never_imports_the_local_brokers() -> None:
    graph = _graph()
    assert any(name.startswith(f"{DEV}.") for name in graph)  # the walk found them
    assert f"{DEV}.tansu" in graph["kiproxy_dev.cli"]  # and sees their imports
    wrong = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                   if dst.startswith(DEV) and not src.startswith(DEV))
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
