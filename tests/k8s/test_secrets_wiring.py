"""Secrets in the manifests reach each process as files, never as argv: each
component mounts only its own Redis user (one key of the Secret), the Redis pod
only the hashed ACL file, the router its API keys; no ``$(VAR)`` of a Secret is
expanded into args; Redis runs with ACL users and no password on its command
line (docs/security.md)."""

from __future__ import annotations

import base64
import re

import pytest

from kvstore.redis_conn import is_cluster_url
from tests.k8s.manifests import Container, Manifest, pod_spec

SERVICES = ("kvstore", "prefill", "decode", "router")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def redis_mount(c: Container) -> tuple[str, list[dict[str, str]]]:
    """(Secret name, projected items) of the container's ``redis`` volume."""
    vols = {v["name"]: v for v in pod_spec(c.workload)["volumes"]}
    secret = vols["redis"]["secret"]
    return secret["secretName"], secret.get("items", [])


@pytest.mark.parametrize("component", SERVICES)
def test_each_component_mounts_only_its_own_redis_user(manifest: Manifest,
                                                       component: str) -> None:
    c = manifest.main_container(component)
    args = c.spec["args"]
    assert "--redis-url" not in args
    assert args[args.index("--redis-url-file") + 1] == f"{c.mount('redis')}/url"
    name, items = redis_mount(c)
    assert items == [{"key": component, "path": "url"}], c.where
    secret = manifest.get("Secret", name)
    url = base64.b64decode(secret["data"][component]).decode()
    assert f"://{component}:" in url                          # its own ACL user


def test_no_secret_is_expanded_into_a_command_line(manifest: Manifest) -> None:
    for c in manifest.containers():
        from_secret = {e["name"] for e in c.spec.get("env", ())
                       if "secretKeyRef" in e.get("valueFrom", {})}
        used = {m for a in [*c.spec.get("args", ()), *c.spec.get("command", ())]
                for m in VAR_REF.findall(a)}
        assert not from_secret & used, f"{c.where}: $({sorted(from_secret & used)}) in argv"
        assert "REDIS_URL" not in {e["name"] for e in c.spec.get("env", ())}, c.where


def test_redis_runs_with_acl_users_from_a_file(manifest: Manifest) -> None:
    if "redis" not in manifest.components():
        return
    c = manifest.main_container("redis")
    args = c.spec["args"]
    assert "--requirepass" not in args and not any("$(" in a for a in args)
    acl = args[args.index("--aclfile") + 1]
    vols = {v["name"]: v for v in pod_spec(c.workload)["volumes"]}
    mounted = next(v for v in vols.values() if v.get("secret", {}).get("items") == [
        {"key": "users.acl", "path": "users.acl"}])
    assert acl == f"{c.mount(mounted['name'])}/users.acl"
    assert not c.spec.get("env"), "the Redis pod needs no secret in its environment"
    for probe in ("startupProbe", "readinessProbe"):
        assert "REDISCLI_AUTH" not in str(c.spec[probe]) and " -a " not in str(c.spec[probe])
    users = base64.b64decode(manifest.get("Secret", mounted["secret"]["secretName"])
                             ["data"]["users.acl"]).decode()
    assert "replace-me" in users or users.startswith("user default off")


def test_the_router_takes_tenants_from_api_keys(manifest: Manifest) -> None:
    c = manifest.main_container("router")
    args = c.spec["args"]
    keys = args[args.index("--api-key-file") + 1]
    vols = {v["name"]: v for v in pod_spec(c.workload)["volumes"]}
    secret = vols["api-keys"]["secret"]
    assert keys == f"{c.mount('api-keys')}/{secret['items'][0]['path']}"
    assert manifest.get("Secret", secret["secretName"])["data"][secret["items"][0]["key"]]


@pytest.mark.parametrize(("target", "scheme"), [("cpu-demo+external-redis", "rediss://"),
                                                ("gpu+redis-cluster+s3-g4", "redis+cluster://")])
def test_external_redis_components_give_each_role_its_own_url(
        rendered: dict[str, Manifest], target: str, scheme: str) -> None:
    m = rendered[target]
    assert "redis" not in m.components()
    for component in SERVICES:
        c = m.main_container(component)
        name, items = redis_mount(c)
        url = base64.b64decode(m.get("Secret", name)["data"][items[0]["key"]]).decode()
        assert url.startswith(scheme) and f"://{component}:" in url
        assert is_cluster_url(url) == scheme.startswith("redis+cluster")
