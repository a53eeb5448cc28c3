"""The package layering, checked on every import statement (function-level
ones included): a package imports only from itself and from layers below
it, never from a sibling on its own layer (decode_svc never reaches into
prefill_svc; what both need lives in ``service``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. Packages on one layer do not know each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("proto", "common", "native"),
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
