"""Who may open a connection to whom, evaluated from rendered NetworkPolicies
with the API's semantics: a pod selected by any Ingress policy is isolated and
admits a peer only if some selecting policy's rule matches both peer and port."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.k8s.manifests import selector_matches

NS_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True, slots=True)
class Peer:
    """A connecting party: a pod (labels, namespace) or a client outside the cluster."""

    name: str
    namespace: str | None = None                 # None: outside the cluster
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {NS_NAME_LABEL: self.namespace} if self.namespace else {}


@dataclass(frozen=True, slots=True)
class Target:
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int]                     # container port name -> number


def _peer_matches(rule_peer: Mapping[str, Any], peer: Peer, namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        # Only clients outside the cluster are modelled as addresses.
        return peer.namespace is None
    if peer.namespace is None:
        return False
    pod_sel = rule_peer.get("podSelector")
    ns_sel = rule_peer.get("namespaceSelector")
    if ns_sel is None:
        ns_ok = peer.namespace == namespace
    else:
        ns_ok = selector_matches(ns_sel, peer.namespace_labels)
    pod_ok = pod_sel is None or selector_matches(pod_sel, peer.labels)
    return ns_ok and pod_ok


def _port_matches(rule_ports: Sequence[Mapping[str, Any]] | None, port_name: str,
                  number: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None or want in (port_name, number):
            return True
    return False


def isolated(policies: Sequence[Mapping[str, Any]], target: Target) -> bool:
    return any(_selects(p, target) for p in policies)


def _selects(policy: Mapping[str, Any], target: Target) -> bool:
    meta, spec = policy["metadata"], policy["spec"]
    types = spec.get("policyTypes") or ["Ingress"]
    return ("Ingress" in types and meta.get("namespace", target.namespace) == target.namespace
            and selector_matches(spec["podSelector"], target.labels))


def admits(policies: Sequence[Mapping[str, Any]], target: Target, peer: Peer,
           port_name: str) -> bool:
    number = target.ports[port_name]
    selecting = [p for p in policies if _selects(p, target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or ():
            sources = rule.get("from")
            peer_ok = not sources or any(_peer_matches(s, peer, target.namespace)
                                         for s in sources)
            if peer_ok and _port_matches(rule.get("ports"), port_name, number):
                return True
    return False
