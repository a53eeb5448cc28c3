"""Every overlay renders with a real kustomize, and every object
validates strictly against the schemas of a current Kubernetes release
(custom resources against their operators' CRD schemas)."""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor
from pydantic import BaseModel

from tests.k8s.conftest import TARGETS
from tests.k8s.manifests import K8S, Manifest
from tests.k8s.render import Renderer

# The newest schema set kubernetes-validate ships (1.37 at the time of writing).
K8S_VERSION = kubernetes_validate.latest_version()

# Custom resources: pydantic models generated from the upstream CRD schemas.
CRD_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
}


def validate_custom(obj: dict[str, Any]) -> None:
    """Type-check against the CRD model, then require a lossless round trip:
    the models ignore unknown fields, so a dropped or coerced field is an error."""
    model = CRD_MODELS[(obj["apiVersion"], obj["kind"])]
    parsed = model.model_validate(obj)
    back = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if back != obj:
        raise ValueError(f"{obj['kind']}/{obj['metadata']['name']}: fields unknown to the CRD "
                         f"schema or of the wrong type:\n{obj}\n!=\n{back}")


def validate(obj: dict[str, Any]) -> None:
    if (obj["apiVersion"], obj["kind"]) in CRD_MODELS:
        validate_custom(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_renderer_is_a_real_kustomize(renderer: Renderer) -> None:
    assert "kustomize" in renderer.version.lower() or renderer.argv[-1] == "build", renderer
    major_minor = tuple(int(x) for x in K8S_VERSION.split(".")[:2])
    assert major_minor >= (1, 33), f"kubernetes-validate ships only schemas up to {K8S_VERSION}"


def test_every_target_renders_distinct_objects(manifest: Manifest) -> None:
    keys = Counter((o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
                   for o in manifest.objects)
    assert keys, f"{manifest.target} rendered nothing"
    assert [k for k, n in keys.items() if n > 1] == []
    assert {"router", "prefill", "decode", "kvstore"} <= manifest.components()


@functools.cache
def validation_error(serialized: str) -> str | None:
    """Targets share most objects: validate each distinct object once per session."""
    obj = json.loads(serialized)
    try:
        validate(obj)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError,
            ValueError) as exc:
        return f"{obj['kind']}/{obj['metadata']['name']}: {exc}"
    return None


def test_every_object_validates_strictly(manifest: Manifest) -> None:
    errors = [validation_error(json.dumps(o, sort_keys=True)) for o in manifest.objects]
    failures = [e for e in errors if e is not None]
    assert failures == [], "\n".join(failures)


def test_overlays_cover_every_component_dir(rendered: dict[str, Manifest]) -> None:
    used = {c for t in TARGETS for c in t.components} | {t.base for t in TARGETS}
    on_disk = {f"overlays/{p.name}" for p in (K8S / "overlays").iterdir() if p.is_dir()}
    on_disk |= {p.name for p in (K8S / "components").iterdir() if p.is_dir()}
    assert on_disk <= used, f"never rendered in tests: {sorted(on_disk - used)}"


MUTATIONS: list[tuple[str, str, Callable[[dict[str, Any]], None]]] = [
    ("Deployment", "kvserve-router",
     lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePullPolice="Always")),
    ("StatefulSet", "kvserve-kvstore",
     lambda o: o["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]
     .update(port="grpc")),
    ("NetworkPolicy", "kvserve-kvstore", lambda o: o["spec"].update(podSelectors={})),
    ("ScaledObject", "kvserve-prefill", lambda o: o["spec"].update(maxReplicas=3)),
    ("ScaledObject", "kvserve-decode", lambda o: o["spec"].update(minReplicaCount="one")),
    ("ServiceMonitor", "kvserve-router", lambda o: o["spec"]["endpoints"][0].update(paht="/m")),
]


@pytest.mark.parametrize(("kind", "name", "mutate"), MUTATIONS,
                         ids=[f"{k}-{n}-{i}" for i, (k, n, _) in enumerate(MUTATIONS)])
def test_validation_rejects_broken_objects(rendered: dict[str, Manifest], kind: str, name: str,
                                           mutate: Callable[[dict[str, Any]], None]) -> None:
    """The checks above would catch a typo or a wrongly typed field."""
    obj = copy.deepcopy(rendered["cpu-demo+prometheus+keda"].get(kind, name))
    validate(obj)
    mutate(obj)
    with pytest.raises((kubernetes_validate.ValidationError, ValueError)):
        validate(obj)
