"""The warehouse's accounting with no tensors: replays traces through the same
``CapacityCache``, eviction policies and per-class TTLs as the live store.

Semantics (those of the store, docs/architecture.md#block-identity):
- a request's blocks are its ``hash_ids``; only full blocks are stored
  (``input_length // block_tokens`` of them; ``cache_partial=True`` also
  stores a trailing partial block, as some published simulations do);
- hit = the leading run of resident, unexpired blocks; hit tokens are
  ``min(hit_blocks * block_tokens, input_length)``;
- then every stored block is touched or inserted, in order, which refreshes
  its TTL (that of the request's class); a block unused for longer than its
  TTL expires: it is removed at that moment (so bytes stored fall) and a later
  use is a miss;
- tiers are exclusive: tier 0 takes new and hit blocks, a tier's evictions
  are demoted to the next tier, the last tier's are dropped.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.trace_arrays import CompactTrace
from common.traces import Trace, TraceRequest
from kvstore.eviction import CapacityCache, make_policy
from studies.replay_core import ENGINES, native_supports, replay_native
from studies.replay_stats import UNLIMITED, ClassStats, ReplayStats, ttl_map

# Llama-3-70B: 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes (bf16).
LLAMA3_70B_KV_BYTES_PER_TOKEN = 327_680
# An order key for Belady: request ordinal, then depth (a child sorts after its parent).
_DEPTH_SLOTS = 1 << 20


@dataclass(frozen=True, slots=True)
class AccessResult:
    hit_blocks: int          # leading resident, unexpired blocks
    hit_tokens: int
    total_blocks: int        # len(hash_ids)
    input_tokens: int
    stored_blocks: int       # newly stored by this request
    evicted_blocks: int      # dropped from the last tier by this request
    tier_hits: tuple[int, ...]   # hit blocks served by each tier


@dataclass(frozen=True, slots=True)
class Future:
    """Per request, the ordinal of the next request using each of its blocks
    (-1: none); what Belady needs. Build it once per trace with ``of``."""

    next_index: tuple[tuple[int, ...], ...]
    times: tuple[float, ...]

    @classmethod
    def of(cls, trace: Trace) -> Future:
        last: dict[int, int] = {}
        out: list[tuple[int, ...]] = [()] * len(trace.requests)
        for i in range(len(trace.requests) - 1, -1, -1):
            ids = trace.requests[i].hash_ids
            out[i] = tuple([last.get(h, -1) for h in ids])
            for h in ids:
                last[h] = i
        return cls(tuple(out), tuple(r.t for r in trace.requests))


class SimWarehouse:
    """One simulated store. Capacities are per tier, in tokens (``None`` =
    unlimited) or, with ``capacity_bytes``, in bytes."""

    def __init__(self, capacity_tokens: int | Sequence[int | None] | None = None, *,
                 policy: str = "lru", ttl_s: float | Mapping[str, float] = math.inf,
                 block_tokens: int = 64,
                 kv_bytes_per_token: int = LLAMA3_70B_KV_BYTES_PER_TOKEN,
                 capacity_bytes: int | Sequence[int] | None = None,
                 cache_partial: bool = False, future: Future | None = None) -> None:
        if block_tokens < 1 or kv_bytes_per_token < 1:
            raise ValueError("block_tokens and kv_bytes_per_token must be >= 1")
        if capacity_bytes is not None and capacity_tokens is not None:
            raise ValueError("give capacity_tokens or capacity_bytes, not both")
        if capacity_bytes is not None:
            caps = [capacity_bytes] if isinstance(capacity_bytes, int) else list(capacity_bytes)
        else:
            toks = (capacity_tokens if isinstance(capacity_tokens, Sequence)
                    else [capacity_tokens])
            caps = [UNLIMITED if c is None or math.isinf(c) else int(c) * kv_bytes_per_token
                    for c in toks]
        if not caps or any(c < 0 for c in caps):
            raise ValueError(f"tier capacities must be >= 0, got {caps}")
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * kv_bytes_per_token
        self.cache_partial = cache_partial
        self.tiers = [CapacityCache(c, make_policy(policy)) for c in caps]
        self.offline = bool(getattr(self.tiers[0].policy, "offline", False))
        self.future = future
        self._ttls, self._ttl_default = ttl_map(ttl_s)
        self._expiring = any(math.isfinite(v) for v in self._ttls.values()) or (
            self._ttl_default is not None and math.isfinite(self._ttl_default))
        self._where: dict[int, int] = {}                 # key -> tier index
        self._cls: dict[int, str] = {}                   # key -> class of its last use
        self._due: dict[str, OrderedDict[int, float]] = {}   # class -> key -> expiry, by expiry
        self._next_key: dict[int, float | None] = {}     # offline: key -> next-use order key
        self.per_class: dict[str, ClassStats] = {}
        self.evictions = 0
        self.expirations = 0
        self.tier_hits = [0] * len(self.tiers)
        self._used = 0
        self.bytes_peak = 0
        self._area = 0.0
        self._t0: float | None = None
        self._t = 0.0

    # ------------------------------------------------------------ queries
    def ttl(self, cls: str) -> float:
        v = self._ttls.get(cls, self._ttl_default)
        if v is None:
            raise ValueError(f"no TTL for traffic class {cls!r}; known: {sorted(self._ttls)} "
                             "(add '*' for a default)")
        return v

    def match(self, hash_ids: Sequence[int], now: float) -> int:
        """Leading blocks a request would hit now, without touching anything."""
        n = 0
        for h in hash_ids:
            if h not in self._where or (self._expiring and self._expired(h, now)):
                break
            n += 1
        return n

    def __contains__(self, key: int) -> bool:
        return key in self._where

    @property
    def used_bytes(self) -> int:
        return self._used

    # ------------------------------------------------------------ replay
    def access(self, request: TraceRequest, *, index: int | None = None) -> AccessResult:
        """Serve one request: count its prefix hit, then store/touch its blocks.
        ``index`` is the request's ordinal in the ``future``'s trace (offline policies)."""
        now = request.t
        if self._t0 is None:
            self._t0 = self._t = now
        if now < self._t:
            raise ValueError(f"request at t={now} arrives before the previous one ({self._t})")
        if self._expiring:
            self._expire(now)
        self._advance(now)
        ids = request.hash_ids
        bt = self.block_tokens
        n_store = len(ids) if self.cache_partial else min(len(ids), request.input_length // bt)
        where = self._where
        hit = 0
        tier_hits = [0] * len(self.tiers)
        for h in ids[:n_store]:
            tier = where.get(h)
            if tier is None:
                break
            tier_hits[tier] += 1
            hit += 1
        cls = request.traffic_class
        nexts = self._next_keys(request, index, n_store, cls) if self.offline else None
        stored = 0
        evicted_before = self.evictions
        ttl = self.ttl(cls) if self._expiring else math.inf
        top = self.tiers[0].policy
        top.begin_request(request.session, ids[:n_store], now, cls)
        for j in range(n_store):
            h = ids[j]
            tier = where.get(h)
            if nexts is not None:
                self._next_key[h] = nexts[j]
                if tier == 0:
                    top.next_use(h, nexts[j])
            if tier == 0:
                top.touch(h, now)
            else:
                if tier is not None:          # promote from a lower tier
                    self.tiers[tier].discard(h)
                    del where[h]
                    self._used -= self.block_bytes
                if not self._put(0, h, cls, now):
                    continue
                stored += tier is None
            if self._expiring:
                self._refresh(h, cls, now + ttl)
            self._cls[h] = cls
        for k, v in enumerate(tier_hits):
            self.tier_hits[k] += v
        hit_tokens = min(hit * bt, request.input_length)
        st = self.per_class.get(cls)
        if st is None:
            st = self.per_class[cls] = ClassStats()
        st.requests += 1
        st.blocks += len(ids)
        st.hit_blocks += hit
        st.tokens += request.input_length
        st.hit_tokens += hit_tokens
        return AccessResult(hit, hit_tokens, len(ids), request.input_length, stored,
                            self.evictions - evicted_before, tuple(tier_hits))

    def _next_keys(self, request: TraceRequest, index: int | None, n: int,
                   cls: str) -> list[float | None]:
        fut = self.future
        if fut is None or index is None:
            raise ValueError("an offline policy (belady) needs SimWarehouse(future=Future.of("
                             "trace)) and access(request, index=i)")
        nxt = fut.next_index[index]
        ttl = self.ttl(cls)
        out: list[float | None] = []
        for j in range(n):
            k = nxt[j]
            # A use after the TTL lapses is a miss whatever the policy: as good as never.
            if k < 0 or fut.times[k] - request.t > ttl:
                out.append(None)
            else:
                out.append(float(k * _DEPTH_SLOTS + min(j, _DEPTH_SLOTS - 1)))
        return out

    def _put(self, level: int, h: int, cls: str, now: float) -> bool:
        """Store ``h`` in tier ``level``, demoting that tier's victims downward."""
        cache = self.tiers[level]
        if self.offline:
            cache.policy.next_use(h, self._next_key.get(h))
        adm = cache.put(h, self.block_bytes, now, cls)
        if not adm.stored:
            self._forget(h)
            return False
        self._where[h] = level
        self._used += self.block_bytes
        for v in adm.evicted:
            self._used -= self.block_bytes
            del self._where[v]
            if level + 1 < len(self.tiers):
                self._put(level + 1, v, self._cls[v], now)
            else:
                self.evictions += 1
                self._forget(v)
        if self._used > self.bytes_peak:
            self.bytes_peak = self._used
        return True

    def _forget(self, h: int) -> None:
        self._where.pop(h, None)
        cls = self._cls.pop(h, None)
        self._next_key.pop(h, None)
        if cls is not None and self._expiring:
            self._due[cls].pop(h, None)

    # ------------------------------------------------------------ TTL and bytes
    def _refresh(self, h: int, cls: str, due: float) -> None:
        old = self._cls.get(h)
        if old is not None and old != cls:
            self._due[old].pop(h, None)
        q = self._due.get(cls)
        if q is None:
            q = self._due[cls] = OrderedDict()
        q[h] = due
        q.move_to_end(h)

    def _expired(self, h: int, now: float) -> bool:
        cls = self._cls.get(h)
        return cls is not None and self._due[cls].get(h, math.inf) < now

    def _expire(self, now: float) -> None:
        # Each class's queue is in expiry order (refreshes move to the end and
        # a class has one TTL), so the earliest expiry is at some queue's head.
        while True:
            best_q, best_due = None, now
            for q in self._due.values():
                if q:
                    due = q[next(iter(q))]
                    if due < best_due:
                        best_q, best_due = q, due
            if best_q is None:
                return
            h, _ = best_q.popitem(last=False)
            self._advance(best_due)
            tier = self._where.pop(h)
            self.tiers[tier].discard(h)
            self._used -= self.block_bytes
            self._cls.pop(h, None)
            self._next_key.pop(h, None)
            self.expirations += 1

    def _advance(self, t: float) -> None:
        if t > self._t:
            self._area += self._used * (t - self._t)
            self._t = t

    def stats(self) -> ReplayStats:
        total = ClassStats()
        for st in self.per_class.values():
            total.add(st)
        span = self._t - (self._t0 or 0.0)
        mean = self._area / span if span > 0 else float(self._used)
        return ReplayStats(
            hit_rate=total.hit_rate, token_hit_rate=total.token_hit_rate,
            per_class={k: ClassStats(v.requests, v.blocks, v.hit_blocks, v.tokens, v.hit_tokens)
                       for k, v in sorted(self.per_class.items())},
            bytes_peak=self.bytes_peak, bytes_mean=mean, evictions=self.evictions,
            expirations=self.expirations, requests=total.requests,
            tier_hits=tuple(self.tier_hits))


_COMPACT_CACHE: list[tuple[Trace, CompactTrace]] = []


def compact_of(trace: Trace) -> CompactTrace:
    """``CompactTrace.from_trace``, remembered for the last two traces (a sweep
    replays one trace many times)."""
    for t, ct in _COMPACT_CACHE:
        if t is trace:
            return ct
    ct = CompactTrace.from_trace(trace)
    _COMPACT_CACHE.insert(0, (trace, ct))
    del _COMPACT_CACHE[2:]
    return ct


def replay_cache(trace: Trace | CompactTrace, *, policy: str = "lru",
                 capacity_tokens: int | Sequence[int | None] | None = None,
                 ttl_s: float | Mapping[str, float] = math.inf,
                 kv_bytes_per_token: int = LLAMA3_70B_KV_BYTES_PER_TOKEN,
                 cache_partial: bool = False, future: Future | None = None,
                 engine: str = "auto") -> ReplayStats:
    """Replay a whole trace through one simulated store (the trace's block size).
    Pass a precomputed ``future`` to reuse it across Belady runs. ``engine``:
    "auto" runs the native core where it can (same results to the bit),
    "native" requires it, "python" forces this module's loop."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine != "python" and native_supports(policy, capacity_tokens):
        ct = trace if isinstance(trace, CompactTrace) else compact_of(trace)
        return replay_native(ct, policy=policy, capacity_tokens=capacity_tokens, ttl_s=ttl_s,
                             kv_bytes_per_token=kv_bytes_per_token,
                             cache_partial=cache_partial)
    if engine == "native":
        raise ValueError(f"the native core cannot run policy {policy!r} with capacities "
                         f"{capacity_tokens!r} (or it is not built)")
    if isinstance(trace, CompactTrace):
        trace = trace.to_trace()
    wh = SimWarehouse(capacity_tokens, policy=policy, ttl_s=ttl_s,
                      block_tokens=trace.block_tokens, kv_bytes_per_token=kv_bytes_per_token,
                      cache_partial=cache_partial, future=None)
    if wh.offline:
        wh.future = future if future is not None else Future.of(trace)
    for i, r in enumerate(trace.requests):
        wh.access(r, index=i)
    return wh.stats()


__all__ = ["LLAMA3_70B_KV_BYTES_PER_TOKEN", "AccessResult", "ClassStats", "Future",
           "ReplayStats", "SimWarehouse", "compact_of", "replay_cache"]
