"""Two resends of an agent's context arrive while its first copy is still being
computed, so each plans its restore from an empty G1. Once the first copy is
done, the prefill service sizes them against G1 as it is: each needs only its
new blocks, and the G1 blocks both reuse count once. Both are admitted in the
same step (sized as planned on arrival, each claimed its whole length, the
second did not fit beside the first, and everything queued behind it waited
one resend at a time)."""

from __future__ import annotations

import asyncio
import threading

from common.config import PrefillSection
from engine import Engine, EngineConfig, SamplingParams
from prefill_svc.config import PrefillConfig
from proto import prefill_pb2
from service.config import Endpoint, EngineSpec
from tests.prefill_svc.inproc import serve_prefill
from tests.prefill_svc.test_scheduling import _until

B = 16
POOL = 32                     # the context's 18 blocks twice do not fit; once plus tails do
SPEC = EngineSpec(model="tiny-dense", block_tokens=B, num_blocks=POOL)


def test_resends_planned_before_g1_grew_are_admitted_together() -> None:
    ctx = [(i * 13) % 250 + 2 for i in range(17 * B + 5)]       # 18 blocks, 17 full
    resends = {"r1": [*ctx, 7, 7, 7], "r2": [*ctx, 8, 8, 8, 8]}
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    want = {rid: ref.generate(t, SamplingParams(max_tokens=1)).tokens[0]
            for rid, t in resends.items()}
    cfg = PrefillConfig(engine=SPEC, endpoint=Endpoint(port=0),
                        scheduler=PrefillSection(policy="fcfs", step_tokens=B),
                        warmup_tokens=0)

    async def body() -> None:
        async with serve_prefill(cfg) as (stub, svc):
            steps = svc.steps
            admitted_at: dict[str, int] = {}      # request id -> steps run before its admission
            apply = steps._apply

            def record(out, entries):  # type: ignore[no-untyped-def]
                apply(out, entries)
                for rid in out.admitted:
                    admitted_at[rid] = svc.stats.steps_total

            steps._apply = record  # type: ignore[method-assign]
            # The engine thread is held while the first copy is planned and both
            # resends arrive: they look G1 up while it is still empty, and the first
            # copy is running (computing their blocks) before they can be admitted.
            gate = threading.Event()
            svc.thread.submit(gate.wait, 60)
            try:
                first = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                    token_ids=ctx, ctx={"request_id": "first"}), timeout=60))
                await _until(lambda: svc.thread.pending == 2, "the first copy's step queued")
                calls = {rid: asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                    token_ids=t, ctx={"request_id": rid}), timeout=60))
                    for rid, t in resends.items()}
                await _until(lambda: len(steps.sched.waiting) == 3, "both resends queued")
            finally:
                gate.set()
            assert (await first).cached_tokens == 0
            got = {rid: await c for rid, c in calls.items()}
            for rid, r in got.items():
                assert r.first_token == want[rid]
                assert r.cached_tokens >= 16 * B, (rid, r.cached_tokens)
            # (the service names requests itself: the first copy is the first admitted)
            at = sorted(admitted_at.values())
            assert len(at) == 3 and at[0] < at[1] == at[2], admitted_at

    asyncio.run(asyncio.wait_for(body(), 120))
