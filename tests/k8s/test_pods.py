"""Pods: every container has requests and limits, probes, and a
locked-down security context; every pod runs under its own ServiceAccount
with no API token mounted."""

from __future__ import annotations

from typing import Any

import pytest

from tests.k8s.manifests import Manifest, pod_spec, quantity, volume

GRPC_COMPONENTS = ("kvstore", "prefill", "decode")
# Startup budget (seconds) before the kubelet gives up: model load for the
# engines and the router, a G3 re-index for the store.
MIN_STARTUP_S = {"router": 300, "prefill": 300, "decode": 300, "kvstore": 600, "redis": 60}


def startup_budget(probe: dict[str, Any]) -> int:
    return (probe.get("initialDelaySeconds", 0)
            + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))


def test_every_container_has_requests_and_limits(manifest: Manifest) -> None:
    for c in manifest.containers():
        res = c.spec.get("resources", {})
        for kind in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(res.get(kind, {}))
            assert not missing, f"{c.where}: resources.{kind} lacks {sorted(missing)}"
        for name, request in res["requests"].items():
            limit = res["limits"].get(name)
            assert limit is not None and quantity(request) <= quantity(limit), (
                f"{c.where}: {name} request {request} exceeds limit {limit}")


def test_every_long_running_container_has_three_probes(manifest: Manifest) -> None:
    for c in manifest.containers(init=False):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c.spec, f"{c.where} has no {probe}"
        budget = startup_budget(c.spec["startupProbe"])
        assert budget >= MIN_STARTUP_S[c.component], (
            f"{c.where}: startup probe allows {budget}s, want >= {MIN_STARTUP_S[c.component]}s")


@pytest.mark.parametrize("component", GRPC_COMPONENTS)
def test_grpc_services_use_native_grpc_health_probes(manifest: Manifest, component: str) -> None:
    c = manifest.main_container(component)
    args = c.spec["args"]
    # The kubelet cannot present a client certificate: probes go to the plain-text
    # health-only port the server opens with --health-port, never the mTLS one.
    assert int(args[args.index("--health-port") + 1]) == c.port("health") != c.port("grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = c.spec[probe].get("grpc")
        assert grpc is not None, f"{c.where}: {probe} is not a native gRPC probe"
        assert grpc["port"] == c.port("health")
        # The standard health service's overall status ("" service name).
        assert grpc.get("service", "") == ""


@pytest.mark.parametrize("component", (*GRPC_COMPONENTS, "router"))
def test_services_mount_their_mtls_identity_from_a_secret(manifest: Manifest,
                                                          component: str) -> None:
    c = manifest.main_container(component)
    args = c.spec["args"]
    assert "--insecure" not in args, f"{c.where} serves plain text"
    vols = {v["name"]: v for v in pod_spec(c.workload)["volumes"]}
    tls = vols["tls"]["secret"]
    # cert-manager's Secret of a Certificate holds tls.crt, tls.key and ca.crt.
    assert tls["secretName"] == f"kvserve-tls-{component}"
    assert args[args.index("--tls-dir") + 1] == c.mount("tls")
    if component != "kvstore":      # services that compute block keys need the secret
        secret_file = args[args.index("--secret-file") + 1]
        assert vols["deployment-secret"]["secret"]["secretName"] == "kvserve-secret"
        assert secret_file == f"{c.mount('deployment-secret')}/secret"
    else:                           # the store only tags and verifies blocks: the MAC key
        assert "deployment-secret" not in vols and "--secret-file" not in args
        assert vols["integrity"]["secret"]["secretName"] == "kvserve-integrity"
        assert args[args.index("--integrity-key-file") + 1] == f"{c.mount('integrity')}/key"


def test_router_probes_http(manifest: Manifest) -> None:
    c = manifest.main_container("router")
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http = c.spec[probe].get("httpGet")
        assert http is not None, f"{c.where}: {probe} is not an HTTP probe"
        assert http["port"] in ("http", c.port("http"))
        paths[probe] = http["path"]
    # /health is 503 while no prefill/decode instance is live: it gates traffic,
    # but must not restart routers (liveness) or stall their start.
    assert paths == {"startupProbe": "/metrics", "readinessProbe": "/health",
                     "livenessProbe": "/metrics"}


def test_every_container_is_locked_down(manifest: Manifest) -> None:
    for c in manifest.containers():
        pod = pod_spec(c.workload).get("securityContext", {})
        sc = c.spec.get("securityContext", {})
        assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, c.where
        assert sc.get("runAsUser", pod.get("runAsUser", 0)) != 0, c.where
        assert sc.get("readOnlyRootFilesystem") is True, c.where
        assert sc.get("allowPrivilegeEscalation") is False, c.where
        assert sc.get("privileged", False) is False, c.where
        caps = sc.get("capabilities", {})
        assert caps.get("drop") == ["ALL"] and not caps.get("add"), c.where
        seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", c.where


def test_read_only_root_leaves_kvserve_a_writable_tmp(manifest: Manifest) -> None:
    for c in manifest.containers():
        if c.is_kvserve:
            assert c.mount("tmp") == "/tmp", f"{c.where}: no writable /tmp volume"
            assert "emptyDir" in volume(c.workload, "tmp")


def test_pods_share_nothing_with_the_host(manifest: Manifest) -> None:
    for w in manifest.workloads():
        spec = pod_spec(w)
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag), f"{w['metadata']['name']}: {flag}"
        assert not [v for v in spec.get("volumes", ()) if "hostPath" in v], w["metadata"]["name"]


def test_every_pod_has_its_own_service_account_without_token(manifest: Manifest) -> None:
    accounts = {sa["metadata"]["name"]: sa for sa in manifest.of_kind("ServiceAccount")}
    used = []
    for w in manifest.workloads():
        spec = pod_spec(w)
        name = spec.get("serviceAccountName", "default")
        assert name in accounts, f"{w['metadata']['name']} runs as missing/default SA {name!r}"
        assert accounts[name].get("automountServiceAccountToken") is False, name
        assert spec.get("automountServiceAccountToken") is False, w["metadata"]["name"]
        used.append(name)
    assert len(used) == len(set(used)), f"ServiceAccounts shared between workloads: {used}"
    assert not set(accounts) - set(used), f"unused ServiceAccounts {set(accounts) - set(used)}"


def test_images_are_pinned_and_consistent(manifest: Manifest) -> None:
    kvserve_images = set()
    for c in manifest.containers():
        image = c.spec["image"]
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"{c.where}: {image}"
        if c.is_kvserve:
            kvserve_images.add(image)
    assert len(kvserve_images) == 1, f"kvserve containers run different images {kvserve_images}"
