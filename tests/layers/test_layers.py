"""The package layering, checked on every import statement (function-level
and ``TYPE_CHECKING`` ones included): a package imports only from itself and
from layers below it, never from a sibling on its own layer (decode_svc never
reaches into prefill_svc; what both need lives in ``service``). And no modules
import each other, directly or round a longer loop, counted on the same
statements: what two modules share lives in a third, lower one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. Packages on one layer do not know each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("proto", "common", "native", "telemetry"),
    ("security",),
    ("engine", "kvstore", "eplb"),
    ("service",),
    ("prefill_svc", "decode_svc"),
    ("router", "connectors"),
    ("studies",),
    ("kvserve",),
    ("benchmarks",),
)
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_edges(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports: ``from a.b import c`` names module
    ``a.b.c`` when that is a file, else the package ``a.b``."""
    me = _module(path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".")[: -node.level if path.name != "__init__.py" else None]
                if path.name == "__init__.py" and node.level > 1:
                    pkg = pkg[: 1 - node.level]
                base = ".".join([*pkg, *([node.module] if node.module else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                out |= {sub} if sub in known else {base} & known
    return out - {me}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _project_graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in LEVEL for p in sorted((ROOT / pkg).rglob("*.py"))
             if "_pb2" not in p.name}
    return {m: _module_edges(p, set(files)) for m, p in files.items()}


def test_every_project_package_has_a_layer() -> None:
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "build"}
    assert found <= set(LEVEL), f"packages without a layer: {sorted(found - set(LEVEL))}"


@pytest.mark.parametrize("pkg", sorted(LEVEL))
def test_imports_go_only_downwards(pkg: str) -> None:
    bad = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        for line, target in _imports(path):
            if target in LEVEL and target != pkg and LEVEL[target] >= LEVEL[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                           f"(layer {LEVEL[target]} >= {LEVEL[pkg]})")
    assert not bad, "\n".join(bad)


def test_no_modules_import_each_other() -> None:
    graph = _project_graph()
    circles = [" <-> ".join(c) + ": " + "; ".join(
        f"{a} imports {', '.join(sorted(graph[a] & set(c)))}" for a in c)
        for c in _cycles(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_cycle_finder_sees_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
