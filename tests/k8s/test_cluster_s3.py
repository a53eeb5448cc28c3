"""The Redis Cluster and S3 options (k8s/components/redis-cluster, s3-g4):
every component's REDIS_URL is the cluster URL, the in-cluster Redis is gone,
and only the kvstore gets the G4 URL, endpoint and S3 credentials."""

from __future__ import annotations

import base64

from kvstore.redis_conn import is_cluster_url
from tests.k8s.manifests import Manifest

TARGET = "gpu+redis-cluster+s3-g4"


def _env(spec: dict[str, object]) -> dict[str, dict[str, object]]:
    return {e["name"]: e for e in spec.get("env", ())}  # type: ignore[attr-defined]


def test_redis_cluster_component_points_everyone_at_the_cluster(
        rendered: dict[str, Manifest]) -> None:
    m = rendered[TARGET]
    assert "redis" not in m.components()
    assert not [o for o in m.objects if o["metadata"]["name"] == "kvserve-redis"]
    secret = m.named("Secret", "kvserve-redis")
    for role in ("kvstore", "prefill", "decode", "router"):   # one ACL user per role
        url = base64.b64decode(secret["data"][role]).decode()
        assert is_cluster_url(url) and url.startswith(f"redis+cluster://{role}:")
        c = m.main_container(role)
        assert c.mount("redis") and "REDIS_URL" not in _env(c.spec), c.where


def test_s3_component_gives_only_the_kvstore_its_g4_and_credentials(
        rendered: dict[str, Manifest]) -> None:
    m = rendered[TARGET]
    cm = m.get("ConfigMap", "kvserve-s3")
    secret = m.get("Secret", "kvserve-s3")
    assert cm["data"]["url"].startswith("s3://") and cm["data"]["endpoint"].startswith("http")
    assert set(secret["data"]) == {"access_key_id", "secret_access_key"}
    c = m.main_container("kvstore")
    args = c.spec["args"]
    assert args[args.index("--g4-url") + 1] == "$(G4_URL)"
    env = _env(c.spec)
    assert env["G4_URL"]["valueFrom"] == {"configMapKeyRef": {"name": cm["metadata"]["name"],
                                                              "key": "url"}}
    assert env["AWS_ENDPOINT_URL_S3"]["valueFrom"]["configMapKeyRef"]["key"] == "endpoint"
    for name, key in (("AWS_ACCESS_KEY_ID", "access_key_id"),
                      ("AWS_SECRET_ACCESS_KEY", "secret_access_key")):
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": secret["metadata"]["name"],
                                                           "key": key}}
    for other in m.containers():
        if other.component != "kvstore":   # least privilege: engines never touch S3
            assert not {"AWS_ACCESS_KEY_ID", "G4_URL"} & set(_env(other.spec)), other.where


def test_base_has_no_g4_or_s3_credentials(rendered: dict[str, Manifest]) -> None:
    m = rendered["gpu"]
    assert "--g4-url" not in m.main_container("kvstore").spec["args"]
    assert not [o for o in m.objects if o["metadata"]["name"].startswith("kvserve-s3")]
