"""The prefill service under a burst, in-process over real gRPC sockets: a
full queue refuses at once with RESOURCE_EXHAUSTED and ``retry-after-ms``
(before any work), callers that leave while queued are dropped, the rest
answer exactly as alone, and no future or task exception is left unread."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import grpc
import pytest

from common.config import PrefillSection
from engine import Engine, SamplingParams
from prefill_svc.config import PrefillConfig
from prefill_svc.scheduler import Entry
from prefill_svc.server import PrefillService
from proto import prefill_pb2
from service.config import Endpoint, EngineSpec
from service.errors import RETRY_AFTER_KEY as RETRY_AFTER_MS
from tests.prefill_svc.inproc import Serving, serve_prefill

SPEC = EngineSpec(model="tiny-dense", block_tokens=16, num_blocks=256)


def serving(sched: PrefillSection) -> Serving:
    return serve_prefill(PrefillConfig(engine=SPEC, endpoint=Endpoint(port=0), scheduler=sched))


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 13 + i * 5) % 250 + 1 for i in range(n)]


async def _until(cond: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


def test_burst_refuses_when_full_drops_leavers_and_leaves_nothing_unread() -> None:
    ref = Engine(SPEC.engine_config())
    prompts = [_tokens(i, 40 + 17 * i) for i in range(30)]
    want = [ref.generate(p, SamplingParams(max_tokens=1)).tokens[0] for p in prompts]
    unread: list[str] = []

    async def body() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: unread.append(str(ctx.get("message"))))
        async with serving(PrefillSection(max_waiting=6, step_tokens=32)) as (stub, svc):
            # Hold the engine thread: nothing is admitted while the burst arrives,
            # so exactly max_waiting requests queue and the rest are refused.
            gate = threading.Event()
            svc.thread.submit(gate.wait, 60)
            calls = []
            try:
                for i, p in enumerate(prompts):
                    calls.append(asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                        token_ids=p, ctx={"request_id": f"r{i}"}),
                        timeout=5.0 if i == 3 else 60)))
                    if i == 5:          # the first six queue, in this order
                        await _until(lambda: svc.steps.sched.queue == 6, "six queued")
                await _checks(calls, svc)
            finally:
                gate.set()
            out = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(out[1], asyncio.CancelledError)
            assert isinstance(out[4], asyncio.CancelledError)
            assert isinstance(out[3], grpc.aio.AioRpcError)
            assert out[3].code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for i in (0, 2, 5):
                h = out[i]
                assert isinstance(h, prefill_pb2.KVHandle), (i, h)
                assert h.first_token == want[i] and h.timings.queue_s > 0.5
            assert svc.stats.admitted_total == 3
            live = await svc.thread.call(lambda: svc.engine.live_sequences)
            # Only finished prompts held for decode's pull (steps.py, resident) stay live.
            assert set(live) == set(svc.steps.resident_ids) and svc.steps.jobs == {}
            assert len(live) <= 3                   # of the three answered ones at most
            assert svc.steps.sched.queue == 0 and not svc.steps.sched.running
        gc.collect()

    asyncio.run(asyncio.wait_for(body(), 120))
    assert not [m for m in unread if "never retrieved" in m], unread


async def _checks(calls: list[asyncio.Future[prefill_pb2.KVHandle]],
                  svc: PrefillService) -> None:
    """While the engine thread is held: 24 refusals, 3 leavers, 3 queued."""
    await _until(lambda: svc.stats.refused_total == 24, "24 refusals")
    # The server counts a refusal before its answer reaches the caller: wait for
    # the callers to hold them (the last one's was still on its way once).
    await _until(lambda: sum(c.done() for c in calls[6:]) == 24, "24 refusals answered")
    for i, c in enumerate(calls):
        if c.done() and i != 3:
            err = c.exception()
            assert isinstance(err, grpc.aio.AioRpcError), i
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "prefill queue full: 6 requests waiting" in err.details()
            meta = dict(err.trailing_metadata() or ())
            assert int(meta[RETRY_AFTER_MS]) >= 1
    queued = [i for i, c in enumerate(calls) if not c.done() or i == 3]
    assert queued == [0, 1, 2, 3, 4, 5]
    assert svc.stats.admitted_total == 0
    calls[1].cancel()                       # two callers hang up while queued
    calls[4].cancel()
    await _until(lambda: calls[3].done(), "request 3's deadline")   # expires queued
    await _until(lambda: svc.stats.cancelled_total == 3, "three leavers dropped")


@pytest.mark.parametrize("policy", ["fcfs", "src"])
def test_concurrent_prompts_share_steps_and_answer_as_alone(policy: str) -> None:
    """12 prompts at once with a 64-token step: they share steps (fewer steps
    than chunks) and every first token is the single run's."""
    ref = Engine(SPEC.engine_config())
    prompts = [_tokens(100 + i, 30 + 41 * i) for i in range(12)]
    want = [ref.generate(p, SamplingParams(max_tokens=1)).tokens[0] for p in prompts]

    async def body() -> None:
        async with serving(PrefillSection(policy=policy, step_tokens=64)) as (stub, svc):
            gate = threading.Event()
            svc.thread.submit(gate.wait, 60)    # all arrive before the first step
            calls = [asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                token_ids=p), timeout=60)) for p in prompts]
            await _until(lambda: svc.steps.sched.queue == len(prompts), "all queued")
            gate.set()
            handles = await asyncio.gather(*calls)
            assert [h.first_token for h in handles] == want
            # The last step's counters land after its copy-out, behind the replies.
            await _until(lambda: not svc.steps.jobs, "every KV buffered")
            st = svc.stats
            assert st.step_tokens_total == sum(len(p) for p in prompts)
            # Every step full but the last, and the first (planned while the engine
            # thread was held, when only the first arrivals had warmed up).
            assert st.steps_total <= -(-st.step_tokens_total // 64) + 1
            assert st.chunks_total > st.steps_total
            # The steps' time (the stack's prefill busy fraction): there, and at most
            # the engine thread's own busy time.
            assert 0 < st.step_seconds_total <= svc.steps._thread.busy_s

    asyncio.run(asyncio.wait_for(body(), 120))


@pytest.mark.parametrize("policy", ["fcfs", "src"])
def test_warm_turn_after_a_running_cold_prompt(policy: str) -> None:
    """A returning turn (its prefix in G1, a few new tokens) arrives while a long
    cold prompt is being computed: ``src`` answers it at the next step, ``fcfs``
    only after the long one. A long prompt whose caller leaves stops between steps."""
    warm = _tokens(7, 300)
    long = _tokens(8, 900)

    async def body() -> None:
        async with serving(PrefillSection(policy=policy, step_tokens=16,
                                          solo_step_tokens=0)) as (stub, svc):
            await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=warm), timeout=60)  # into G1
            sched = svc.steps.sched

            def entry(where: dict[str, Entry], n: int) -> Entry | None:
                return next((e for e in where.values() if e.prompt_tokens == n), None)

            cold = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                token_ids=long), timeout=60))
            await _until(lambda: entry(sched.running, 900), "the long prompt running")
            gate, hold = threading.Event(), threading.Event()
            svc.thread.submit(gate.wait, 60)        # at most the step in flight completes
            seen: dict[str, tuple[bool, int]] = {}
            try:
                turn = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                    token_ids=[*warm, 9, 10, 11]), timeout=60))
                await _until(lambda: (e := entry(sched.waiting, 303)) and e.ready, "turn warmed")
                long_entry = entry(sched.running, 900)
                assert long_entry is not None
                before = long_entry.remaining

                def answered(_: object) -> None:
                    # Runs on the loop as the turn's first token is settled, before the
                    # step loop plans again: the long prompt as that step left it. The
                    # engine thread is then held, so its caller can leave mid-prompt
                    # however fast the steps run.
                    seen["long"] = (long_entry.request_id in sched.running,
                                    long_entry.remaining)
                    svc.thread.submit(hold.wait, 60)
                turn_job: Any = entry(sched.waiting, 303).payload   # type: ignore[union-attr]
                turn_job.first.add_done_callback(answered)
            finally:
                gate.set()
            try:
                await _until(lambda: "long" in seen, "the turn answered")
                running, left = seen["long"]
                if policy == "src":
                    # Answered at the next step: at most the step in flight went before it.
                    assert running and left >= before - 16
                    assert (await turn).cached_tokens == 288
                    cold.cancel()               # the long one's caller leaves mid-prompt
                    hold.set()
                    await _until(lambda: svc.stats.stopped_total == 1, "the long prompt stopped")
                    live = await svc.thread.call(lambda: svc.engine.live_sequences)
                    assert set(live) == set(svc.steps.resident_ids)     # held for their pull
                    assert long_entry.request_id not in live
                else:
                    assert not running or left < 16     # the long one went first
                    hold.set()
                    await cold
                    await turn
            finally:
                hold.set()

    asyncio.run(asyncio.wait_for(body(), 120))
