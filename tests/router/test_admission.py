"""The admission layer on its own: fair queues, per-key limits, bounded waits,
429s with Retry-After, 503 only without instances (no processes needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc
import pytest

from common.config import AdmissionSection, ConfigError, KVServeConfig
from router.admission import Admission, Capacity, Ticket
from router.admission_cost import InflightPrefixes, admission_cost
from router.admission_limits import DrainRate, TokenBucket, retry_after_s
from router.admission_queue import FairQueue, Waiter
from router.errors import (
    NoInstanceError,
    RateLimitedError,
    busy_seconds,
    http_error,
    upstream_error,
)
from router.metrics import RouterMetrics

CFG = AdmissionSection(max_queue_wait_s=5.0, prefill_depth=1, prefill_tokens=10_000,
                       decode_slots=8, fair_quantum_tokens=100)


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 30))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _sample(m: RouterMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


ONE_EACH = Capacity(prefill=1, decode=1)


def _admission(cfg: AdmissionSection = CFG, cap: Capacity = ONE_EACH,
               clock: Callable[[], float] | None = None) -> tuple[Admission, RouterMetrics]:
    m = RouterMetrics()
    kw = {"clock": clock} if clock else {}
    return Admission(cfg, lambda: cap, m, **kw), m  # type: ignore[arg-type]


# -- the fair queue --------------------------------------------------------------------------


def _drain(q: FairQueue, eligible: Callable[[Waiter], bool] = lambda w: True) -> list[str]:
    out = []
    while (w := q.pop(eligible)) is not None:
        out.append(w.tenant)
    return out


def test_fair_queue_alternates_tenants_whatever_their_backlog() -> None:
    async def body() -> None:
        q = FairQueue(quantum=100)
        for _ in range(6):
            q.push(Waiter("ka", "A", 100, 0.0))
        q.push(Waiter("kb", "B", 100, 1.0))
        q.push(Waiter("kb", "B", 100, 2.0))
        assert len(q) == 8 and q.depths() == {"A": 6, "B": 2}
        assert _drain(q) == ["A", "B", "A", "B", "A", "A", "A", "A"]
        assert len(q) == 0

    run(body)


def test_fair_queue_shares_prompt_tokens_not_requests() -> None:
    """Tenant A sends 400-token prompts, B 100-token ones: per quantum of 100,
    B gets four requests through for each of A's."""
    async def body() -> None:
        q = FairQueue(quantum=100)
        for _ in range(3):
            q.push(Waiter("ka", "A", 400, 0.0))
        for _ in range(12):
            q.push(Waiter("kb", "B", 100, 0.0))
        order = _drain(q)
        assert order[:10] == ["B", "B", "B", "A", "B", "B", "B", "B", "A", "B"]
        assert order.count("A") == 3 and order.count("B") == 12

    run(body)


def test_fair_queue_passes_over_requests_held_back_without_credit() -> None:
    async def body() -> None:
        q = FairQueue(quantum=100)
        held = Waiter("busy-key", "A", 100, 0.0)
        q.push(held)
        q.push(Waiter("kb", "B", 100, 0.0))
        q.push(Waiter("ka2", "A", 100, 0.0))
        # A's first request is held back (its key is at its limit): A's next one goes.
        assert _drain(q, lambda w: w.key != "busy-key") == ["A", "B"]
        assert q.pop(lambda w: w.key != "busy-key") is None and len(q) == 1
        assert q.remove(held) and len(q) == 0 and not q.remove(held)

    run(body)


def test_cost_ahead_is_what_drr_serves_first() -> None:
    async def body() -> None:
        q = FairQueue(quantum=100)
        for _ in range(10):
            q.push(Waiter("ka", "A", 100, 0.0))       # A: 1000 tokens waiting
        q.push(Waiter("kb", "B", 50, 0.0))            # B: 50
        # A new B request of 100: its own 150, and at most as much of A's.
        assert q.cost_ahead("B", 100) == 150 + 150
        assert q.cost_ahead("A", 100) == 1100 + 50
        assert q.cost_ahead("C", 10) == 10 + 10 + 10

    run(body)


# -- limits and estimates --------------------------------------------------------------------


def test_token_bucket_rate_and_burst() -> None:
    b = TokenBucket(rate=2.0, burst=2)
    assert b.take(10.0) == 0.0 and b.take(10.0) == 0.0
    assert b.take(10.0) == pytest.approx(0.5)
    assert b.take(10.25) == pytest.approx(0.25)
    assert b.take(10.5) == 0.0
    assert not b.full(10.5) and b.full(11.5)
    assert TokenBucket(rate=0.0, burst=0).take(0.0) == 0.0       # no limit


def test_drain_rate_counts_only_backlogged_intervals() -> None:
    r = DrainRate(min_samples=2)
    r.dispatched(0.0, 100, backlogged=False)
    r.dispatched(1.0, 100, backlogged=True)
    assert r.tokens_per_s() is None                                # one sample
    r.dispatched(2.0, 300, backlogged=True)
    assert r.tokens_per_s() == pytest.approx(200.0)
    r.idle()
    r.dispatched(60.0, 100, backlogged=True)                       # after an idle gap
    assert r.tokens_per_s() == pytest.approx(200.0)
    assert r.wait_s(1000) == pytest.approx(5.0)
    assert retry_after_s(0.01) == 1 and retry_after_s(2.2) == 3


def test_admission_config_is_validated_and_read_from_toml() -> None:
    with pytest.raises(ConfigError, match="request_timeout_s must be >= max_queue_wait_s"):
        AdmissionSection(max_queue_wait_s=10, request_timeout_s=5)
    with pytest.raises(ConfigError, match="key_max_concurrency"):
        AdmissionSection(key_max_concurrency=-1)
    cfg = KVServeConfig.from_dict({"admission": {"key_rate_per_s": 2.5, "max_queue_wait_s": 3}})
    assert cfg.admission.key_rate_per_s == 2.5 and cfg.admission.burst == 2
    assert KVServeConfig().admission == AdmissionSection()


# -- the admission decisions ------------------------------------------------------------------


def test_waits_for_room_then_goes_and_the_wait_is_measured() -> None:
    async def body() -> None:
        adm, m = _admission()
        first = await adm.admit("k", "A", 50)
        assert first.waited_s == 0.0
        second = asyncio.create_task(adm.admit("k", "A", 50))
        await asyncio.sleep(0.05)
        assert not second.done() and adm.queued == 1
        assert _sample(m, "kvserve_router_queue_depth", tenant="A") == 1
        adm.prefilled(first)                      # prefill room frees: the next goes
        t = await second
        assert t.waited_s >= 0.04 and adm.queued == 0
        assert _sample(m, "kvserve_router_admitted_total") == 2
        assert _sample(m, "kvserve_router_queue_wait_seconds_count") == 2
        assert _sample(m, "kvserve_router_queue_wait_seconds_sum") >= 0.04
        assert _sample(m, "kvserve_router_in_service", stage="service") == 2
        adm.done(first)
        adm.done(t)
        adm.done(t)                               # idempotent
        assert _sample(m, "kvserve_router_in_service", stage="service") == 0

    run(body)


def test_a_request_still_waiting_at_the_bound_gets_429_before_any_work() -> None:
    async def body() -> None:
        adm, m = _admission(replace(CFG, max_queue_wait_s=0.2))
        held = await adm.admit("k", "A", 10)
        with pytest.raises(RateLimitedError) as info:
            await adm.admit("k", "A", 10)
        err = info.value
        assert err.reason == "queue_timeout" and err.retry_after_s >= 1
        resp = http_error(err)
        assert resp.status == 429 and resp.headers == {"Retry-After": str(err.retry_after_s)}
        assert resp.body["error"]["code"] == "queue_timeout"
        assert adm.queued == 0
        assert _sample(m, "kvserve_router_rejected_total", reason="queue_timeout") == 1
        adm.done(held)
        assert (await adm.admit("k", "A", 10)).waited_s == 0.0    # nothing left behind

    run(body)


def test_per_key_rate_limit_answers_429_with_retry_after() -> None:
    async def body() -> None:
        clock = Clock()
        adm, m = _admission(replace(CFG, key_rate_per_s=1.0, key_burst=2,
                                    decode_slots=100, prefill_depth=100), clock=clock)
        await adm.admit("flood", "A", 1)
        await adm.admit("flood", "A", 1)
        with pytest.raises(RateLimitedError) as info:
            await adm.admit("flood", "A", 1)
        assert info.value.reason == "rate_limited" and info.value.retry_after_s == 1
        await adm.admit("calm", "B", 1)          # another key has its own bucket
        clock.t += 1.0
        await adm.admit("flood", "A", 1)
        assert _sample(m, "kvserve_router_rejected_total", reason="rate_limited") == 1

    run(body)


def test_per_key_concurrency_lets_another_key_pass_first() -> None:
    async def body() -> None:
        adm, _ = _admission(replace(CFG, key_max_concurrency=1, prefill_depth=4))
        a1 = await adm.admit("flood", "A", 10)
        a2 = asyncio.create_task(adm.admit("flood", "A", 10))     # waits: key at its limit
        await asyncio.sleep(0.02)
        b1 = await adm.admit("calm", "B", 10)                     # passes at once
        assert b1.waited_s == 0.0 and not a2.done()
        adm.done(a1)
        assert (await a2).key == "flood"

    run(body)


def test_a_flooding_tenant_cannot_starve_another() -> None:
    """Twenty of A's requests wait; B's, arriving last, is the second to go."""
    async def body() -> None:
        adm, _ = _admission()
        running = await adm.admit("ka", "A", 100)
        order: list[str] = []

        async def one(key: str, tenant: str) -> None:
            t = await adm.admit(key, tenant, 100)
            order.append(tenant)
            await asyncio.sleep(0)
            adm.done(t)

        tasks = [asyncio.create_task(one("ka", "A")) for _ in range(20)]
        await asyncio.sleep(0.02)
        tasks.append(asyncio.create_task(one("kb", "B")))
        await asyncio.sleep(0.02)
        adm.done(running)
        await asyncio.gather(*tasks)
        assert order.index("B") <= 1 and len(order) == 21

    run(body)


def test_refused_up_front_when_the_estimated_wait_exceeds_the_slo() -> None:
    """Once the queue's drain rate is known, a request that would wait longer
    than max_queue_wait_s is refused at once, with the excess as Retry-After."""
    async def body() -> None:
        clock = Clock()
        adm, m = _admission(replace(CFG, max_queue_wait_s=5.0, fair_quantum_tokens=1000),
                            clock=clock)
        held = await adm.admit("k", "A", 100)
        waiting = [asyncio.create_task(adm.admit("k", "A", 100)) for _ in range(12)]
        await asyncio.sleep(0.02)
        for i in range(6):                        # drains at 100 tokens/s, in FIFO order
            clock.t += 1.0
            adm.done(held)
            held = await waiting[i]
        assert adm.queued == 6                    # 600 tokens ahead of a newcomer: ~6 s
        with pytest.raises(RateLimitedError) as info:
            await adm.admit("k2", "A", 100)
        assert info.value.reason == "over_slo" and info.value.retry_after_s == 2
        assert _sample(m, "kvserve_router_rejected_total", reason="over_slo") == 1
        for t in waiting[6:]:
            t.cancel()
        await asyncio.gather(*waiting[6:], return_exceptions=True)
        assert adm.queued == 0

    run(body)


def test_no_instance_is_503_and_busy_instances_say_when() -> None:
    async def body() -> None:
        adm, m = _admission(cap=Capacity(prefill=1, decode=0))
        with pytest.raises(NoInstanceError) as info:
            await adm.admit("k", "A", 10)
        assert http_error(info.value).status == 503
        assert _sample(m, "kvserve_router_rejected_total", reason="no_instance") == 1

    run(body)
    busy = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(("retry-after-ms", "250")), "queue full")
    assert busy_seconds(busy) == 0.25
    err = upstream_error(busy, role="prefill", instance="p1")
    assert getattr(err, "busy_s", None) == 0.25 and getattr(err, "retryable", False)
    broken = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                  grpc.aio.Metadata(), "gone")
    assert getattr(upstream_error(broken, role="prefill", instance="p1"), "busy_s", 1) is None


def test_ticket_wait_left() -> None:
    t = Ticket("k", "A", 1, arrived=10.0, waited_s=0.0)
    assert t.wait_left(CFG, 12.0) == pytest.approx(3.0)


# -- cost: tokens still to compute (router.admission_cost) ----------------------------------


def test_a_resent_context_costs_its_tail_while_the_first_copy_is_in_flight() -> None:
    inflight = InflightPrefixes()
    context = [bytes([i]) * 16 for i in range(86)]        # 86 blocks of 64: 5,504 tokens
    first = inflight.claim(context)
    assert admission_cost(5504, 64, inflight.leading(context)) == 64     # all held
    assert admission_cost(5504, 64, inflight.leading(context[:40])) == 5504 - 40 * 64
    resend = [*context, b"new-turn" * 2, b"new-tail" * 2]  # 100 tokens of new text
    assert inflight.leading(resend) == 86
    assert admission_cost(5604, 64, inflight.leading(resend)) == 100
    second = inflight.claim(resend)
    first.release()
    first.release()                                        # idempotent
    assert inflight.leading(context) == 86                 # the resend still holds it
    second.release()
    assert inflight.leading(context) == 0 and len(inflight) == 0
    # Nothing held: the whole prompt; a short prompt never costs more than itself.
    assert admission_cost(5504, 64, 0) == 5504
    assert admission_cost(10, 64, 0) == 10



def test_a_request_admitted_as_its_wait_runs_out_is_served_not_refused() -> None:
    """The room frees in the instant the bounded wait ends: the waiter was
    admitted (its wait counted, its room taken), so it is served; refusing it
    then counted one request both as admitted and as refused (the overload
    test's wait count off by one)."""
    async def body() -> None:
        adm, m = _admission()
        held = await adm.admit("k", "A", 10)
        # Frees the room while the zero-length wait below is being cancelled.
        asyncio.get_running_loop().call_soon(adm.done, held)
        t = await adm.admit("k", "A", 10, wait_s=0.0)
        assert _sample(m, "kvserve_router_admitted_total") == 2
        assert _sample(m, "kvserve_router_queue_wait_seconds_count") == 2
        assert _sample(m, "kvserve_router_rejected_total", reason="queue_timeout") == 0
        assert _sample(m, "kvserve_router_in_service", stage="service") == 1
        adm.done(t)
        assert _sample(m, "kvserve_router_in_service", stage="service") == 0

    run(body)
