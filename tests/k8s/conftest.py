"""Renders every overlay (and overlays with the optional components) once per
session with a real kustomize; tests take one ``manifest`` per target."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.k8s.manifests import K8S, Manifest
from tests.k8s.render import INSTALL_HINT, Renderer, find_renderer


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    base: str                                   # a kustomization under k8s/
    components: tuple[str, ...] = ()            # k8s/components/<name>


TARGETS = (
    Target("base", "base"),
    Target("cpu-demo", "overlays/cpu-demo"),
    Target("gpu", "overlays/gpu"),
    Target("cpu-demo+prometheus+keda", "overlays/cpu-demo", ("prometheus", "keda")),
    Target("gpu+prometheus+keda", "overlays/gpu", ("prometheus", "keda")),
    Target("cpu-demo+prometheus+observability", "overlays/cpu-demo",
           ("prometheus", "observability")),
    Target("cpu-demo+external-redis", "overlays/cpu-demo", ("external-redis",)),
    Target("gpu+redis-cluster+s3-g4", "overlays/gpu", ("redis-cluster", "s3-g4")),
)
OVERLAYS = tuple(t.name for t in TARGETS if t.name != "base")


def kustomization_dir(target: Target, scratch: Path) -> Path:
    """The directory to render: the overlay itself, or a scratch kustomization
    adding components to it (kustomize accepts only relative paths there)."""
    if not target.components:
        return K8S / target.base
    root = scratch / target.name
    root.mkdir(parents=True, exist_ok=True)

    def rel(p: Path) -> str:
        return os.path.relpath(p, root)

    comps = "".join(f"  - {rel(K8S / 'components' / c)}\n" for c in target.components)
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel(K8S / target.base)}\ncomponents:\n{comps}")
    return root


@pytest.fixture(scope="session")
def renderer() -> Renderer:
    found = find_renderer()
    if found is None:
        pytest.fail(INSTALL_HINT)
    return found


@pytest.fixture(scope="session")
def rendered(renderer: Renderer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Manifest]:
    scratch = tmp_path_factory.mktemp("kustomize")
    return {t.name: Manifest(t.name, tuple(renderer.render(kustomization_dir(t, scratch))))
            for t in TARGETS}


@pytest.fixture(params=[t.name for t in TARGETS])
def manifest(request: pytest.FixtureRequest, rendered: dict[str, Manifest]) -> Manifest:
    return rendered[request.param]


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, rendered: dict[str, Manifest]) -> Manifest:
    return rendered[request.param]
