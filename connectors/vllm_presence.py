"""A vLLM instance's presence in kvserve's control plane (Redis), best effort.

* Registry: the scheduler-side connector registers the instance
  (``kvstore.registry``) with its OpenAI address, role, model fingerprint,
  capacity (KV blocks) and load, and heartbeats it, so the router places
  requests on it like on its own engines.
* KV events: blocks this instance now holds in its own prefix cache (G1) are
  announced on ``kvserve:events`` under its instance id, and blocks that left
  it (estimated with an LRU of vLLM's block count: vLLM does not tell a
  connector what it evicts) as evicted, so cache-aware placement sends a
  repeat to the instance that holds the prefix.
* Counters: loads, hits, load errors, degradation ... in the hash
  ``kvserve:vllm:stats:<instance>`` (both processes add to it), read by
  ``kvserve status`` and the tests.

All of it runs on one daemon thread with its own event loop; Redis being down
costs a log line per interval, never a request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from kvstore.events import DEFAULT_MAXLEN, KIND_EVICTED, KIND_STORED, STREAM
from kvstore.registry import InstanceInfo, InstanceRegistry, LoadReport

log = logging.getLogger(__name__)
STATS_PREFIX = "kvserve:vllm:stats:"


def stats_key(instance_id: str) -> str:
    return STATS_PREFIX + instance_id


@dataclass(frozen=True, slots=True)
class Load:
    requests: int
    tokens: int
    capacity_requests: int


class LocalBlocks:
    """The G1 picture: keys this instance's prefix cache probably holds, LRU
    bounded by its block count. ``touch`` returns (new keys, evicted keys)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def touch(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        new: list[bytes] = []
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
            else:
                self._keys[k] = None
                new.append(k)
        gone: list[bytes] = []
        while len(self._keys) > self.capacity:
            gone.append(self._keys.popitem(last=False)[0])
        return new, gone


class Presence:
    def __init__(self, redis_url: str, instance_id: str, *, heartbeat_s: float = 1.0,
                 ttl_s: float = 5.0) -> None:
        self.redis_url = redis_url
        self.instance_id = instance_id
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._events: list[tuple[str, str, bytes]] = []       # (kind, node, keys)
        self._info: InstanceInfo | None = None
        self._load: Callable[[], Load] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-presence", daemon=True)
        self._thread.start()

    # -- what the connector reports ----------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def register(self, info: InstanceInfo, load: Callable[[], Load]) -> None:
        with self._lock:
            self._info, self._load = info, load

    def publish_g1(self, node: str, stored: list[bytes], evicted: list[bytes]) -> None:
        with self._lock:
            if stored:
                self._events.append((KIND_STORED, node, b"".join(stored)))
            if evicted:
                self._events.append((KIND_EVICTED, node, b"".join(evicted)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 5.0)

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        r = aioredis.Redis.from_url(self.redis_url, socket_timeout=2.0)
        reg = InstanceRegistry(self.redis_url, ttl_s=self.ttl_s)
        registered = False
        try:
            while True:
                stopping = self._stop.is_set()
                try:
                    registered = await self._flush(r, reg, registered)
                except Exception as exc:  # Redis down: keep counting, retry next interval
                    log.warning("kvserve presence: %s", exc)
                    registered = False
                if stopping:
                    break
                await asyncio.sleep(0.2 if self._pending() else self.heartbeat_s / 2)
            if registered and self._info is not None:
                await reg.deregister(self._info.instance_id)
        except Exception as exc:
            log.warning("kvserve presence: deregister failed: %s", exc)
        finally:
            await reg.close()
            await r.aclose()

    def _pending(self) -> bool:
        with self._lock:
            return bool(self._events or self._counts)

    async def _flush(self, r: aioredis.Redis, reg: InstanceRegistry, registered: bool) -> bool:
        with self._lock:
            counts, self._counts = self._counts, collections.Counter()
            events, self._events = self._events, []
            info, load = self._info, self._load
        try:
            pipe = r.pipeline(transaction=False)
            for name, n in counts.items():
                pipe.hincrby(stats_key(self.instance_id), name, n)
            for kind, node, keys in events:
                pipe.xadd(STREAM, {"kind": kind, "node": node, "tier": "G1",
                                   "instance": self.instance_id, "keys": keys},
                          maxlen=DEFAULT_MAXLEN, approximate=True)
            if counts or events:
                await pipe.execute()
        except Exception:
            with self._lock:        # not lost: merged back for the next attempt
                self._counts.update(counts)
                self._events[:0] = events
            raise
        if info is None or load is None:
            return registered
        now = load()
        report = LoadReport(load=min(1.0, now.requests / max(1, now.capacity_requests)),
                            queue=now.requests, tokens_in_flight=now.tokens)
        if not registered or not await reg.heartbeat(info.instance_id, report):
            await reg.register(info)
            await reg.heartbeat(info.instance_id, report)
        return True
