"""Wiring: Services reach the containers' ports, only the router
is reachable from outside, the store only from the engines, disruption
budgets and autoscalers cover the right workloads, and the tiers fit the
volumes and memory that back them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.k8s.manifests import (
    COMPONENT_LABEL,
    Container,
    Manifest,
    Obj,
    pod_labels,
    pod_spec,
    quantity,
    selector_matches,
    volume,
)
from tests.k8s.netpol import Peer, Target, admits, isolated

NAMESPACE = "kvserve"


def selected_workloads(manifest: Manifest, selector: dict[str, str]) -> list[Obj]:
    return [w for w in manifest.workloads()
            if selector_matches({"matchLabels": selector}, pod_labels(w))]


def test_workload_selectors_match_their_pods(manifest: Manifest) -> None:
    for w in manifest.workloads():
        assert selector_matches(w["spec"]["selector"], pod_labels(w)), w["metadata"]["name"]


def test_service_ports_match_container_ports(manifest: Manifest) -> None:
    for svc in manifest.of_kind("Service"):
        name = svc["metadata"]["name"]
        targets = selected_workloads(manifest, svc["spec"]["selector"])
        assert len(targets) == 1, f"Service {name} selects {len(targets)} workloads"
        ports = {p["name"]: p for c in pod_spec(targets[0])["containers"]
                 for p in c.get("ports", ())}
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            match = ports.get(target) if isinstance(target, str) else next(
                (p for p in ports.values() if p["containerPort"] == target), None)
            assert match is not None, f"Service {name}:{sp['name']}: no container port {target}"
            assert sp["port"] == match["containerPort"], f"Service {name} port {sp['name']}"
            assert sp.get("protocol", "TCP") == match.get("protocol", "TCP")


def test_statefulsets_are_governed_by_headless_services(manifest: Manifest) -> None:
    for sts in manifest.of_kind("StatefulSet"):
        svc = manifest.get("Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None"
        assert selected_workloads(manifest, svc["spec"]["selector"]) == [sts]


def pod_peers(manifest: Manifest) -> dict[str, Peer]:
    peers = {pod_labels(w)[COMPONENT_LABEL]: Peer(pod_labels(w)[COMPONENT_LABEL],
                                                  NAMESPACE, pod_labels(w))
             for w in manifest.workloads()}
    peers["outside-the-cluster"] = Peer("outside-the-cluster")
    peers["other-namespace"] = Peer("other-namespace", "default", {"app": "x"})
    return peers


def reachable_from(manifest: Manifest, component: str, port: str) -> set[str]:
    policies = manifest.of_kind("NetworkPolicy")
    w = manifest.workload(component)
    ports = {p["name"]: p["containerPort"] for c in pod_spec(w)["containers"]
             for p in c.get("ports", ())}
    target = Target(NAMESPACE, pod_labels(w), ports)
    assert isolated(policies, target), f"{component} pods are not isolated by any policy"
    return {name for name, peer in pod_peers(manifest).items()
            if name != component and admits(policies, target, peer, port)}


def test_network_policies_expose_only_the_router(overlay: Manifest) -> None:
    outside = {"outside-the-cluster", "other-namespace"}
    for w in overlay.workloads():
        component = pod_labels(w)[COMPONENT_LABEL]
        for c in pod_spec(w)["containers"]:
            for p in c.get("ports", ()):
                sources = reachable_from(overlay, component, p["name"])
                if component == "router":
                    assert outside <= sources, f"router:{p['name']} unreachable from outside"
                else:
                    assert not sources & outside, f"{component}:{p['name']} open to {sources}"


def test_store_only_from_engines_and_redis_only_from_kvserve(overlay: Manifest) -> None:
    assert reachable_from(overlay, "kvstore", "grpc") == {"prefill", "decode"}
    assert reachable_from(overlay, "prefill", "grpc") == {"router", "decode"}
    assert reachable_from(overlay, "decode", "grpc") == {"router", "prefill"}
    if "redis" in overlay.components():
        assert reachable_from(overlay, "redis", "redis") == {"kvstore", "prefill", "decode",
                                                             "router"}


@pytest.mark.parametrize("component", ["kvstore", "prefill", "decode"])
def test_metrics_open_to_monitoring_only_with_the_prometheus_component(
        rendered: dict[str, Manifest], component: str) -> None:
    monitoring = Peer("prometheus", "monitoring", {"app": "prometheus"})
    for name, want in (("cpu-demo", False), ("cpu-demo+prometheus+keda", True)):
        m = rendered[name]
        c = m.main_container(component)
        target = Target(NAMESPACE, pod_labels(c.workload),
                        {"grpc": c.port("grpc"), "metrics": c.port("metrics")})
        policies = m.of_kind("NetworkPolicy")
        assert admits(policies, target, monitoring, "metrics") is want, name
        assert admits(policies, target, monitoring, "grpc") is False, name


def test_network_policy_evaluator_sees_a_hole(rendered: dict[str, Manifest]) -> None:
    """Opening the store to everyone is detected, so the checks above can fail."""
    m = rendered["cpu-demo"]
    policies = m.of_kind("NetworkPolicy")
    w = m.workload("kvstore")
    target = Target(NAMESPACE, pod_labels(w), {"grpc": 50051})
    outside = Peer("outside-the-cluster")
    assert not admits(policies, target, outside, "grpc")
    hole = {"metadata": {"name": "hole", "namespace": NAMESPACE},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]}}
    assert admits([*policies, hole], target, outside, "grpc")


def test_every_workload_has_a_non_blocking_disruption_budget(manifest: Manifest) -> None:
    pdbs = manifest.of_kind("PodDisruptionBudget")
    for w in manifest.workloads():
        covering = [p for p in pdbs if selector_matches(p["spec"]["selector"], pod_labels(w))]
        assert len(covering) == 1, f"{w['metadata']['name']}: {len(covering)} PDBs"
        spec = covering[0]["spec"]
        replicas = w["spec"].get("replicas", 1)
        if "maxUnavailable" in spec:
            assert int(spec["maxUnavailable"]) >= 1
        else:  # minAvailable must leave room to evict one pod, or drains hang
            assert int(spec["minAvailable"]) < replicas, w["metadata"]["name"]


def autoscaled(manifest: Manifest) -> list[str]:
    names = [h["spec"]["scaleTargetRef"]["name"]
             for h in manifest.of_kind("HorizontalPodAutoscaler")]
    names += [s["spec"]["scaleTargetRef"]["name"] for s in manifest.of_kind("ScaledObject")]
    return names


def test_router_scales_with_an_hpa_and_nothing_is_scaled_twice(manifest: Manifest) -> None:
    router = manifest.workload("router")
    hpa = next(h for h in manifest.of_kind("HorizontalPodAutoscaler")
               if h["spec"]["scaleTargetRef"]["name"] == router["metadata"]["name"])
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in router["spec"], "the HPA owns the router's replica count"
    names = autoscaled(manifest)
    assert len(names) == len(set(names)), f"two autoscalers on one workload: {names}"
    workloads = {w["metadata"]["name"] for w in manifest.workloads()}
    assert set(names) <= workloads


def test_keda_scales_prefill_and_decode_separately(rendered: dict[str, Manifest]) -> None:
    for name in ("cpu-demo+prometheus+keda", "gpu+prometheus+keda"):
        m = rendered[name]
        scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in m.of_kind("ScaledObject")}
        assert set(scaled) == {m.workload("prefill")["metadata"]["name"],
                               m.workload("decode")["metadata"]["name"]}
        queries = {s["spec"]["triggers"][0]["metadata"]["query"] for s in scaled.values()}
        assert len(queries) == 2, "prefill and decode must scale on their own queues"


def exported_metrics() -> dict[str, set[str]]:
    """Metric names the engines' /metrics serve (prefix kvserve_<role>, one group
    per stats source, as service/hosting.py and the services' metric_sources)."""
    from decode_svc.batcher import BatcherStats
    from prefill_svc.server import PrefillStats
    from service.metrics import StatsCollector

    sources = {"prefill": {"prefill": PrefillStats}, "decode": {"batch": BatcherStats}}
    return {role: {fam.name for fam in StatsCollector(f"kvserve_{role}", src).collect()}
            for role, src in sources.items()}


def test_keda_queries_name_metrics_the_engines_export(rendered: dict[str, Manifest]) -> None:
    exported = exported_metrics()
    for so in rendered["gpu+prometheus+keda"].of_kind("ScaledObject"):
        role = so["metadata"]["labels"][COMPONENT_LABEL]
        query = so["spec"]["triggers"][0]["metadata"]["query"]
        names = set(re.findall(r"\b(kvserve_[a-z0-9_]+)\b", query))
        assert names and names <= exported[role], f"{role}: {names - exported[role]} not exported"


def test_service_monitors_select_services_and_ports(rendered: dict[str, Manifest]) -> None:
    m = rendered["gpu+prometheus+keda"]
    monitored = {sm["metadata"]["name"] for sm in m.of_kind("ServiceMonitor")}
    assert monitored == {"kvserve-router", "kvserve-prefill", "kvserve-decode", "kvserve-kvstore"}
    for sm in m.of_kind("ServiceMonitor"):
        services = [s for s in m.of_kind("Service")
                    if selector_matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
        assert len(services) == 1, sm["metadata"]["name"]
        names = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= names


def shm_and_memory(c: Container) -> tuple[Obj, int]:
    shm = volume(c.workload, next(m["name"] for m in c.spec["volumeMounts"]
                                  if m["mountPath"] == "/dev/shm"))
    return shm, int(quantity(c.spec["resources"]["limits"]["memory"]))


def test_kvstore_tiers_fit_their_volumes(manifest: Manifest, tmp_path: Path) -> None:
    _, cfg = manifest.config(tmp_path)
    store = manifest.main_container("kvstore")
    assert store.workload["kind"] == "StatefulSet"
    # G2: the POSIX shared-memory arena is a memory-backed /dev/shm charged to the pod.
    shm, memory_limit = shm_and_memory(store)
    assert shm["emptyDir"].get("medium") == "Memory"
    assert cfg.tiers.g2_bytes <= quantity(shm["emptyDir"]["sizeLimit"]) <= memory_limit
    assert memory_limit - cfg.tiers.g2_bytes >= 512 * 2**20, "no room for the store process"
    # G3: a per-pod claim mounted where the config and --g3-path say.
    claim = volume(store.workload, "g3")["persistentVolumeClaim"]["spec"]
    assert cfg.tiers.g3_bytes <= quantity(claim["resources"]["requests"]["storage"])
    assert store.mount("g3") == cfg.tiers.g3_path


def test_local_pv_storage_class_where_the_overlay_keeps_it(manifest: Manifest) -> None:
    claim = volume(manifest.workload("kvstore"), "g3")["persistentVolumeClaim"]["spec"]
    classes = {s["metadata"]["name"]: s for s in manifest.of_kind("StorageClass")}
    if manifest.target.startswith("cpu-demo"):
        assert "storageClassName" not in claim and not classes  # the cluster's default class
        return
    sc = classes[claim["storageClassName"]]
    assert sc["provisioner"] == "kubernetes.io/no-provisioner"
    assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
    anti = pod_spec(manifest.workload("kvstore"))["affinity"]["podAntiAffinity"]
    term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"  # one store per node


def test_redis_maxmemory_fits_its_limit(manifest: Manifest) -> None:
    if "redis" not in manifest.components():
        return
    c = manifest.main_container("redis")
    args = c.spec["args"]
    maxmemory = quantity(args[args.index("--maxmemory") + 1])
    assert maxmemory < quantity(c.spec["resources"]["limits"]["memory"])
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_external_redis_component_removes_in_cluster_redis(rendered: dict[str, Manifest]) -> None:
    m = rendered["cpu-demo+external-redis"]
    assert "redis" not in m.components()
    assert not [o for o in m.objects if o["metadata"]["name"] == "kvserve-redis"]
    secret = m.named("Secret", "kvserve-redis")
    for role in ("kvstore", "prefill", "decode", "router"):
        c = m.main_container(role)
        vols = {v["name"]: v for v in c.workload["spec"]["template"]["spec"]["volumes"]}
        assert vols["redis"]["secret"] == {"secretName": secret["metadata"]["name"],
                                           "defaultMode": 0o440,
                                           "items": [{"key": role, "path": "url"}]}, c.where


@pytest.mark.parametrize("name", ["cpu-demo", "gpu"])
def test_overlays_live_in_a_restricted_namespace(rendered: dict[str, Manifest], name: str) -> None:
    m = rendered[name]
    ns = m.get("Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for o in m.objects:
        if o["kind"] not in ("Namespace", "StorageClass"):
            assert o["metadata"].get("namespace") == NAMESPACE, o["metadata"]["name"]


def test_cpu_demo_is_one_replica_each_on_cpu(rendered: dict[str, Manifest], tmp_path: Path) -> None:
    m = rendered["cpu-demo"]
    _, cfg = m.config(tmp_path)
    assert cfg.model.device == "cpu" and cfg.model.name == "smollm2"
    for w in m.workloads():
        assert w["spec"].get("replicas", 1) == 1, w["metadata"]["name"]
    assert m.get("HorizontalPodAutoscaler", "kvserve-router")["spec"]["minReplicas"] == 1
    assert not [c for c in m.containers() if "nvidia.com/gpu" in c.spec["resources"]["limits"]]


def test_gpu_overlay_puts_engines_on_gpus(rendered: dict[str, Manifest], tmp_path: Path) -> None:
    m = rendered["gpu"]
    _, cfg = m.config(tmp_path)
    assert cfg.model.device == "cuda"
    for component in ("prefill", "decode"):
        c = m.main_container(component)
        res = c.spec["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] >= 1
        spec = pod_spec(c.workload)
        assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu"
                                            for t in spec["tolerations"])
    store = pod_spec(m.workload("kvstore"))
    assert store["nodeSelector"] == pod_spec(m.workload("prefill"))["nodeSelector"]
    assert "nvidia.com/gpu" not in m.main_container("router").spec["resources"]["limits"]
    base_cfg = rendered["base"].config(tmp_path)[1]
    assert cfg.tiers.g2_bytes > base_cfg.tiers.g2_bytes
    assert cfg.tiers.g3_bytes > base_cfg.tiers.g3_bytes
