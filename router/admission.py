"""The router's one admission layer: every request passes it before any
instance does work for it (docs/router.md, "Admission").

``admit`` decides, in order:

1. no live instance of a role at all: 503 (``NoInstanceError``), at once;
2. the API key's token bucket is empty: 429 ``rate_limited``;
3. the key already has ``key_max_queued`` waiting, or all queues together
   ``max_queued``: 429 ``queue_full``;
4. the wait it would see (the fair queue's tokens ahead of it over the
   measured drain rate) exceeds ``max_queue_wait_s``: 429 ``over_slo``, up
   front rather than after waiting;
5. room now and nobody eligible waiting: go; else wait in its tenant's fair
   queue (router.admission_queue) until room is made for it, or 429
   ``queue_timeout`` at ``max_queue_wait_s`` (still before any work).

Room is counted per stage: requests in prefill (at most ``prefill_depth``
requests and ``prefill_tokens`` prompt tokens per live prefill instance; one
request always passes an empty stage) and requests in service (at most
``decode_slots`` per live decode instance), plus the key's own
``key_max_concurrency``. The live instance counts come from the registry
(their heartbeats and load reports, through router.live_view), so capacity
follows instances joining and leaving. A 429 carries ``Retry-After``.

A request's cost, in every count above, is the prompt tokens still to compute
(router.admission_cost), not its length: a resent context costs its new tail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.config import AdmissionSection
from router.admission_limits import DrainRate, KeyLimits, retry_after_s
from router.admission_queue import FairQueue, Waiter
from router.errors import NoInstanceError, RateLimitedError
from router.metrics import RouterMetrics


@dataclass(frozen=True, slots=True)
class Capacity:
    """Live instances per role."""

    prefill: int
    decode: int


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request: which room it holds until ``done``."""

    key: str
    tenant: str
    cost: int
    arrived: float
    waited_s: float
    in_prefill: bool = True
    done: bool = False

    def wait_left(self, cfg: AdmissionSection, now: float) -> float:
        """What is left of the bounded wait (for instances that are all busy)."""
        return self.arrived + cfg.max_queue_wait_s - now


class Admission:
    def __init__(self, cfg: AdmissionSection, capacity: Callable[[], Capacity],
                 metrics: RouterMetrics, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._capacity = capacity
        self._metrics = metrics
        self._clock = clock
        self._queue = FairQueue(cfg.fair_quantum_tokens)
        self._keys = KeyLimits(cfg.key_rate_per_s, cfg.burst, cfg.key_max_concurrency,
                               cfg.key_max_queued)
        self._rate = DrainRate()
        self._standing = False            # the queue stood non-empty since the last dispatch
        self._in_prefill = 0
        self._prefill_tokens = 0
        self._in_service = 0

    # -- the decision ------------------------------------------------------------------

    async def admit(self, key: str, tenant: str, cost: int, *,
                    wait_s: float | None = None) -> Ticket:
        """Room for one request of ``cost`` prompt tokens, or an error before any
        work. ``key``: the API key's id ("" without keys: the tenant's own).
        ``wait_s`` caps the wait below ``max_queue_wait_s`` (the request's own
        deadline)."""
        key = key or f"tenant:{tenant}"
        cost = max(1, cost)
        now = self._clock()
        cap = self._capacity()
        if cap.prefill < 1 or cap.decode < 1:
            self._refused("no_instance")
            role = "prefill" if cap.prefill < 1 else "decode"
            raise NoInstanceError(f"no live {role} instance is registered")
        st = self._keys.state(key)
        wait = st.bucket.take(now)
        if wait > 0:
            self._keys.forget_idle(key, now)
            raise self._limited("rate_limited", wait,
                                f"API key over its rate of {self.cfg.key_rate_per_s:g} "
                                "requests/s")
        if st.waiting >= self.cfg.key_max_queued or len(self._queue) >= self.cfg.max_queued:
            raise self._limited("queue_full", self._estimate(tenant, cost) or 1.0,
                                "too many requests waiting"
                                + (" for this API key" if st.waiting >= self.cfg.key_max_queued
                                   else ""))
        if self._room(cap, cost) and self._keys.may_start(key) and not self._eligible_waiting():
            return self._start(key, tenant, cost, now, now)
        est = self._estimate(tenant, cost)
        if est is not None and est > self.cfg.max_queue_wait_s:
            raise self._limited("over_slo", est - self.cfg.max_queue_wait_s,
                                f"the queue's wait (about {est:.0f}s) exceeds the "
                                f"{self.cfg.max_queue_wait_s:g}s this deployment allows")
        return await self._wait(Waiter(key, tenant, cost, now), wait_s)

    async def _wait(self, w: Waiter, wait_s: float | None) -> Ticket:
        st = self._keys.state(w.key)
        st.waiting += 1
        self._queue.push(w)
        self._gauge(w.tenant)
        bound = self.cfg.max_queue_wait_s if wait_s is None else min(wait_s,
                                                                     self.cfg.max_queue_wait_s)
        try:
            await asyncio.wait_for(asyncio.shield(w.admitted), max(0.0, bound))
        except BaseException as exc:
            won = w.admitted.done() and not w.admitted.cancelled()
            if won and isinstance(exc, TimeoutError):
                # Admitted in the same instant its wait ran out: it holds its room
                # and its wait is counted, so it is served (refusing it now would
                # count one request both admitted and refused).
                pass
            elif won:
                # Admitted, but the caller is gone (cancelled): give the room back.
                self.done(Ticket(w.key, w.tenant, w.cost, w.arrived, 0.0))
                self._gauge(w.tenant)
                raise
            else:
                self._queue.remove(w)
                w.admitted.cancel()
                if not self._queue:
                    self._standing = False
                    self._rate.idle()
                self._gauge(w.tenant)
                if not isinstance(exc, TimeoutError):
                    raise
                if self._capacity().prefill < 1 or self._capacity().decode < 1:
                    self._refused("no_instance")
                    raise NoInstanceError("no live instance became available while the "
                                          "request waited") from None
                raise self._limited("queue_timeout", self._estimate(w.tenant, w.cost) or 1.0,
                                    f"no room within {bound:.1f}s") from None
        finally:
            st.waiting -= 1
            self._keys.forget_idle(w.key, self._clock())
        self._gauge(w.tenant)
        return Ticket(w.key, w.tenant, w.cost, w.arrived, self._clock() - w.arrived)

    # -- room ------------------------------------------------------------------------------

    def prefilled(self, t: Ticket) -> None:
        """The request left prefill (its handle is out): that room goes to the next."""
        if t.in_prefill and not t.done:
            t.in_prefill = False
            self._in_prefill -= 1
            self._prefill_tokens -= t.cost
            self._set_stage_gauges()
            self.pump()

    def done(self, t: Ticket) -> None:
        """The request left service (finished, failed or abandoned). Idempotent."""
        if t.done:
            return
        self.prefilled(t)
        t.done = True
        self._in_service -= 1
        self._keys.state(t.key).in_service -= 1
        self._keys.forget_idle(t.key, self._clock())
        self._set_stage_gauges()
        self.pump()

    def pump(self) -> None:
        """Let waiting requests go, in fair order, while there is room (also
        called when instances join)."""
        cap = self._capacity()
        while self._queue:
            w = self._queue.pop(lambda x: self._room(cap, x.cost) and
                                self._keys.may_start(x.key))
            if w is None:
                return
            now = self._clock()
            self._rate.dispatched(now, w.cost, backlogged=self._standing)
            self._standing = bool(self._queue)
            self._start(w.key, w.tenant, w.cost, w.arrived, now)
            w.admitted.set_result(None)
            self._gauge(w.tenant)

    def _room(self, cap: Capacity, cost: int) -> bool:
        if self._in_service >= self.cfg.decode_slots * cap.decode:
            return False
        if self._in_prefill == 0:
            return cap.prefill > 0
        return (self._in_prefill < self.cfg.prefill_depth * cap.prefill
                and self._prefill_tokens + cost <= self.cfg.prefill_tokens * cap.prefill)

    def _eligible_waiting(self) -> bool:
        return any(self._keys.may_start(w.key) for w in self._queue)

    def _start(self, key: str, tenant: str, cost: int, arrived: float, now: float) -> Ticket:
        self._in_prefill += 1
        self._prefill_tokens += cost
        self._in_service += 1
        self._keys.state(key).in_service += 1
        self._metrics.admitted.inc()
        self._metrics.queue_wait_seconds.observe(now - arrived)
        self._set_stage_gauges()
        return Ticket(key, tenant, cost, arrived, now - arrived)

    # -- estimates and reporting --------------------------------------------------------

    def _estimate(self, tenant: str, cost: int) -> float | None:
        return self._rate.wait_s(self._queue.cost_ahead(tenant, cost))

    def _limited(self, reason: str, wait_s: float, message: str) -> RateLimitedError:
        self._refused(reason)
        return RateLimitedError(message, reason=reason, retry_after_s=retry_after_s(wait_s))

    def _refused(self, reason: str) -> None:
        self._metrics.rejected.labels(reason=reason).inc()

    def _gauge(self, tenant: str) -> None:
        self._metrics.queue_depth.labels(tenant=tenant).set(self._queue.depth(tenant))

    def _set_stage_gauges(self) -> None:
        self._metrics.in_service.labels(stage="prefill").set(self._in_prefill)
        self._metrics.in_service.labels(stage="service").set(self._in_service)

    @property
    def queued(self) -> int:
        return len(self._queue)
