"""One place that turns a Redis URL into a client, single server or Redis Cluster.

``redis://`` / ``rediss://`` / ``unix://``: one server (redis-py's ``Redis``).
``redis+cluster://[:password@]host:port[/0]`` / ``rediss+cluster://``: a Redis
Cluster reached through one seed node; redis-py's ``RedisCluster`` discovers
the rest and follows MOVED/ASK and failovers. Every component (index,
registry, KV events, sweeper) connects through here, so a cluster URL in
``REDIS_URL`` switches them all.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

AsyncClient = aioredis.Redis | AsyncRedisCluster


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """The seed node's ``redis://`` URL (a cluster database is always 0)."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        return url
    return urlunsplit((scheme, parts.netloc, "/0", parts.query, parts.fragment))


def connect(url: str, **kwargs: Any) -> AsyncClient:
    """An asyncio client for ``url`` (see the module doc for the forms)."""
    if is_cluster_url(url):
        return AsyncRedisCluster.from_url(plain_url(url), **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)


def connect_sync(url: str, **kwargs: Any) -> redis.Redis | RedisCluster:
    if is_cluster_url(url):
        return RedisCluster.from_url(plain_url(url), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def is_cluster_client(client: object) -> bool:
    return isinstance(client, AsyncRedisCluster | RedisCluster)


__all__ = ["AsyncClient", "connect", "connect_sync", "is_cluster_client", "is_cluster_url",
           "plain_url"]
