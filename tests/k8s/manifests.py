"""A typed view over one rendered kustomization: workloads, containers,
services and the kvserve config they carry, plus Kubernetes quantities and
label selectors, so the tests read as statements about the deployment."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from common.config import KVServeConfig

Obj = dict[str, Any]

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CONFIG_MAP = "kvserve-config"
CONFIG_KEY = "kvserve.toml"
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
KVSERVE_IMAGES = ("kvserve", "kvserve-cuda")     # image names the overlays use

_QUANTITY = re.compile(r"^([+-]?\d+(?:\.\d+)?)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity ("500m", "6Gi", 2) or a Redis size ("768mb") as a number."""
    m = _QUANTITY.match(str(value))
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {value!r}")
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics (matchLabels and matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Container:
    workload: Obj
    spec: Obj
    init: bool

    @property
    def component(self) -> str:
        return pod_labels(self.workload).get(COMPONENT_LABEL, "")

    @property
    def is_kvserve(self) -> bool:
        return self.spec["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1] in KVSERVE_IMAGES

    @property
    def where(self) -> str:
        kind = "initContainer" if self.init else "container"
        w = self.workload
        return f"{w['kind']}/{w['metadata']['name']} {kind} {self.spec['name']}"

    def port(self, name: str) -> int:
        for p in self.spec.get("ports", ()):
            if p.get("name") == name:
                return int(p["containerPort"])
        raise KeyError(f"{self.where} has no port named {name!r}")

    def env_names(self) -> set[str]:
        return {e["name"] for e in self.spec.get("env", ())}

    def mount(self, volume: str) -> str | None:
        for m in self.spec.get("volumeMounts", ()):
            if m["name"] == volume:
                return str(m["mountPath"])
        return None


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Obj) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"].get("labels") or {})


def volume(workload: Obj, name: str) -> Obj:
    for v in pod_spec(workload).get("volumes", ()):
        if v["name"] == name:
            return dict(v)
    for t in workload["spec"].get("volumeClaimTemplates", ()):
        if t["metadata"]["name"] == name:
            return {"name": name, "persistentVolumeClaim": t}
    raise KeyError(f"{workload['metadata']['name']} has no volume {name!r}")


@dataclass(frozen=True, slots=True)
class Manifest:
    target: str
    objects: tuple[Obj, ...]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        for o in self.of_kind(kind):
            if o["metadata"]["name"] == name:
                return o
        raise KeyError(f"{self.target}: no {kind}/{name}")

    def named(self, kind: str, prefix: str) -> Obj:
        """An object whose generated name (hash suffix) starts with ``prefix-``."""
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"].startswith(prefix + "-")]
        if len(found) != 1:
            raise KeyError(f"{self.target}: want one {kind} named {prefix}-<hash>, got {found}")
        return found[0]

    def workloads(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]

    def workload(self, component: str) -> Obj:
        found = [w for w in self.workloads() if pod_labels(w).get(COMPONENT_LABEL) == component]
        if len(found) != 1:
            raise KeyError(f"{self.target}: want one workload for {component!r}, got {len(found)}")
        return found[0]

    def components(self) -> set[str]:
        return {pod_labels(w).get(COMPONENT_LABEL, "") for w in self.workloads()}

    def containers(self, *, init: bool = True) -> Iterator[Container]:
        for w in self.workloads():
            spec = pod_spec(w)
            if init:
                for c in spec.get("initContainers", ()):
                    yield Container(w, c, True)
            for c in spec["containers"]:
                yield Container(w, c, False)

    def main_container(self, component: str) -> Container:
        w = self.workload(component)
        return Container(w, pod_spec(w)["containers"][0], False)

    def config_text(self) -> str:
        return str(self.named("ConfigMap", CONFIG_MAP)["data"][CONFIG_KEY])

    def config(self, tmp_dir: Path) -> tuple[Path, KVServeConfig]:
        path = tmp_dir / f"{self.target.replace('+', '_')}.toml"
        path.write_text(self.config_text())
        return path, KVServeConfig.load(path)
