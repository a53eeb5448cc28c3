"""Prefill's queue time split by its cause (prefill_svc/scheduler.py,
``WAIT_REASONS``): each part moves when its cause happens, with real
services (gRPC, a tiny engine, a real kvstore for the warehouse part), and
the parts add up to the queue time the service already reported."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from common.config import PrefillSection
from prefill_svc.config import PrefillConfig
from prefill_svc.scheduler import WAIT_REASONS, Entry, Scheduler
from prefill_svc.server import PrefillService
from proto import prefill_pb2, prefill_pb2_grpc
from service.config import CostConfig, Endpoint, EngineSpec
from service.metrics import StatsCollector
from tests.prefill_svc import procs
from tests.prefill_svc.inproc import serve_prefill
from tests.prefill_svc.test_scheduling import _until

B = 16
SPEC = EngineSpec(model="tiny-dense", block_tokens=B, num_blocks=256)
HOLD_S = 0.3                        # how long a test keeps the engine thread busy
Stub = prefill_pb2_grpc.PrefillStub


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 29 + i * 11) % 250 + 1 for i in range(n)]


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 120))


def _config(spec: EngineSpec = SPEC, store: str = "", **sched: object) -> PrefillConfig:
    return PrefillConfig(engine=spec, endpoint=Endpoint(port=0, store_address=store),
                         # Steps of step_tokens even for a prompt alone: the waits are the point.
                         scheduler=PrefillSection(**{"solo_step_tokens": 0, **sched}),  # type: ignore[arg-type]
                         cost=CostConfig(fetch_policy="always"), warmup_tokens=0,
                         local_prefix_cache=not store)


def _split(svc: PrefillService) -> dict[str, float]:
    return dict(svc.stats.queue_split_seconds_total)


async def _booked(svc: PrefillService, admitted: int) -> None:
    """The split is booked on the loop once the step that admitted a request
    returns; the engine thread answers the request first (its first token goes out
    before the step's finishing work), so under load the answer can reach the test
    before the booking: wait for it."""
    await _until(lambda: svc.stats.admitted_total >= admitted, f"{admitted} admissions booked")


def _adds_up(svc: PrefillService) -> None:
    """The parts cover the queue time, less the tokenization before a request queues."""
    total, parts = svc.stats.queue_wait_s_total, sum(_split(svc).values())
    assert set(_split(svc)) <= set(WAIT_REASONS)
    assert parts <= total + 1e-3
    assert parts >= total - 0.05 * svc.stats.admitted_total


async def _two_behind_a_busy_engine(stub: Stub, svc: PrefillService, a: list[int],
                                    b: list[int]) -> tuple[prefill_pb2.KVHandle, ...]:
    """``a`` then ``b`` queued and warmed while the engine thread is held for
    HOLD_S, then let go together (a first)."""
    gate = threading.Event()
    svc.thread.submit(gate.wait, 60)
    try:
        ca = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
            token_ids=a, ctx={"request_id": "a"}), timeout=60))
        await _until(lambda: svc.steps.sched.queue == 1, "a queued")
        cb = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
            token_ids=b, ctx={"request_id": "b"}), timeout=60))
        await _until(lambda: svc.steps.sched.queue == 2
                     and all(e.ready for e in svc.steps.sched.waiting.values()), "both warmed")
        await asyncio.sleep(HOLD_S)
    finally:
        gate.set()
    handles = await ca, await cb
    await _booked(svc, 2)
    return handles


def test_a_busy_engine_thread_counts_as_engine_and_the_parts_add_up() -> None:
    async def body() -> None:
        async with serve_prefill(_config(policy="fcfs")) as (stub, svc):
            await _two_behind_a_busy_engine(stub, svc, _tokens(1, 40), _tokens(2, 40))
            split = _split(svc)
            # Both waited out the held engine thread, ready and planned.
            assert split["engine"] >= 2 * HOLD_S * 0.9
            assert split.get("pool", 0) == split.get("held", 0) == split.get("running", 0) == 0
            _adds_up(svc)
            names = {m.name: m for m in StatsCollector(
                "kvserve_prefill", svc.metric_sources()).collect()}
            fam = names["kvserve_prefill_prefill_queue_split_seconds"]
            assert {s.labels["kind"]: s.value for s in fam.samples}["engine"] == split["engine"]
            assert "kvserve_prefill_prefill_finish_seconds" in names
            assert svc.stats.finish_seconds_total > 0

    run(body)


def test_max_running_counts_as_running() -> None:
    async def body() -> None:
        async with serve_prefill(_config(policy="fcfs", max_running=1, step_tokens=B)) as (
                stub, svc):
            await _two_behind_a_busy_engine(stub, svc, _tokens(3, 12 * B), _tokens(4, 40))
            # b waited while a, the one running prompt, took its 12 steps.
            assert _split(svc)["running"] > 0
            assert _split(svc).get("budget", 0) == 0
            _adds_up(svc)

    run(body)


def test_a_step_spent_on_earlier_prompts_counts_as_budget() -> None:
    async def body() -> None:
        async with serve_prefill(_config(policy="fcfs", step_tokens=B)) as (stub, svc):
            await _two_behind_a_busy_engine(stub, svc, _tokens(5, 12 * B), _tokens(6, 40))
            # Room for both, but a (first come) takes each step's 16 tokens whole.
            assert _split(svc)["budget"] > 0
            assert _split(svc).get("running", 0) == _split(svc).get("held", 0) == 0
            _adds_up(svc)

    run(body)


def test_a_resend_waiting_for_its_prefix_counts_as_held() -> None:
    a = _tokens(7, 24 * B)
    async def body() -> None:
        async with serve_prefill(_config(policy="fcfs", step_tokens=B)) as (stub, svc):
            _, hb = await _two_behind_a_busy_engine(stub, svc, a, [*a, 5, 6, 7])
            assert _split(svc)["held"] > 0
            assert hb.cached_tokens == len(a)         # admitted as a G1 hit once a was done
            _adds_up(svc)

    run(body)


def test_a_full_pool_counts_as_pool_and_its_demotions_are_timed() -> None:
    small = EngineSpec(model="tiny-dense", block_tokens=B, num_blocks=10)
    a, b = _tokens(8, 100), _tokens(9, 100)             # 7 blocks each: one at a time

    async def body() -> None:
        async with serve_prefill(_config(small, resident_s=600.0)) as (stub, svc):
            await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=30)
            assert svc.stats.demote_seconds_total == 0
            await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=b), timeout=30)
            await _booked(svc, 2)
            # b found a's resident prompt in the pool: a went to the host first.
            assert svc.stats.handoff_demoted_total == 1
            assert svc.stats.demote_seconds_total > 0
            assert _split(svc)["pool"] > 0
            _adds_up(svc)

    run(body)


def test_a_warehouse_fetch_counts_as_warm(redis_url: str, tmp_path: Path) -> None:
    config = procs.write_config(tmp_path / "kvserve.toml", block_tokens=B)
    store = procs.store(config, redis_url, tmp_path)
    procs.start_all(store)
    a = _tokens(10, 20 * B + 3)

    async def body() -> None:
        # No G1 prefix cache: the second copy of a comes from the warehouse.
        async with serve_prefill(_config(store=store.address)) as (stub, svc):
            await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=60)
            await _until(lambda: svc.writer.stats.stored_blocks_total >= 20, "a written")
            await _booked(svc, 1)
            warm0, fetch0 = _split(svc).get("warm", 0.0), svc.restorer.stats.seconds_total
            h = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=60)
            await _booked(svc, 2)
            assert h.cached_tokens == 20 * B
            fetch = svc.restorer.stats.seconds_total - fetch0
            assert fetch > 0
            assert _split(svc)["warm"] - warm0 >= fetch    # lookup + fetch, while it waited
            _adds_up(svc)

    try:
        run(body)
    finally:
        store.kill()


# -- the plan's reasons, exactly (pure bookkeeping) ----------------------------------------

def _ready(s: Scheduler, rid: str, arrival: float, remaining: int, blocks: int = 1,
           keys: tuple[bytes, ...] = ()) -> Entry:
    e = Entry(rid, remaining, arrival, remaining, blocks, keys=keys, block_tokens=64 if keys
              else 0)
    s.add(e)
    s.mark_ready(e, remaining, blocks)
    return e


@pytest.mark.parametrize(("kw", "left", "free", "want"), [
    ({"max_running": 1}, 10, 100, "running"),       # the one running prompt runs
    ({"step_tokens": 64}, 640, 100, "budget"),      # it takes the whole step
    ({}, 10, 1, "pool"),                            # one free block: the second stops both
])
def test_plan_says_why_each_ready_request_waits(kw: dict[str, int], left: int, free: int,
                                                want: str) -> None:
    s = Scheduler(PrefillSection(policy="fcfs", **kw), tokens_per_s=1000.0)  # type: ignore[arg-type]
    first = _ready(s, "first", 0.0, left, blocks=2)
    s.admitted(first, left)
    _ready(s, "second", 1.0, 64, blocks=2)
    _ready(s, "third", 2.0, 64, blocks=1)
    p = s.plan(free_blocks=free, now=2.0)
    assert p.blocked == {"second": want, "third": want}


def test_plan_names_a_hold_for_a_running_prefix() -> None:
    s = Scheduler(PrefillSection(policy="fcfs", step_tokens=64), tokens_per_s=1000.0)
    keys = tuple(bytes([i]) * 16 for i in range(10))
    first = _ready(s, "first", 0.0, 640, blocks=10, keys=keys)
    s.admitted(first, 640)
    _ready(s, "resend", 1.0, 700, blocks=11, keys=(*keys, b"x" * 16))
    assert s.plan(free_blocks=100, now=1.0).blocked == {"resend": "held"}


def test_charge_moves_the_time_since_the_last_change_to_the_old_reason() -> None:
    e = Entry("r", 100, 10.0, 100, 2)
    e.charge(10.5, "engine")              # warm from arrival
    e.charge(10.75, "pool")
    e.charge(11.5, "")                    # admitted
    assert e.waits == {"warm": 0.5, "engine": 0.25, "pool": 0.75}
