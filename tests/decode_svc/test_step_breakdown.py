"""The decode service says where a step's time goes (decode_svc/batcher.py's
``step_*`` stats, in /metrics and at DEBUG): issue 18's run 6 saw 398 ms steps
where the engine's forward took 6.3 ms, and nothing in the stack's own counters
broke that down."""

from __future__ import annotations

import asyncio
import logging

import pytest

from decode_svc.batcher import Batcher
from engine import Engine, EngineConfig, SamplingParams
from service.engine_thread import EngineThread
from service.metrics import StatsCollector

CFG = EngineConfig(model="tiny-dense", block_tokens=16, num_blocks=256)


def _run(eng: Engine, n: int, tokens: int) -> Batcher:
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=1)

    async def body() -> Batcher:
        thread = EngineThread("test-decode")
        batcher = Batcher(eng, thread, max_seqs=n)
        batcher.start()

        async def one(i: int) -> None:
            prompt = [(i * 13 + j) % 250 + 1 for j in range(40)]
            async for _ in batcher.generate(
                    f"s{i}", lambda i=i, p=prompt: eng.prefill(f"s{i}", p, sampling=sp),
                    prompt_tokens=len(prompt), kv_blocks=eng.kv_blocks_for(40, tokens)):
                pass
        try:
            await asyncio.gather(*(one(i) for i in range(n)))
            return batcher
        finally:
            await batcher.close()
            thread.close()

    return asyncio.run(asyncio.wait_for(body(), 120))


def test_each_step_is_timed_in_parts(caplog: pytest.LogCaptureFixture) -> None:
    eng = Engine(CFG)
    with caplog.at_level(logging.DEBUG, logger="decode_svc.batcher"):
        batcher = _run(eng, 6, 10)
    st = batcher.stats
    assert st.steps_total > 0 and sum(st.step_seconds.counts) == st.steps_total
    assert st.step_rows_total >= st.steps_total
    assert eng.last_step is not None and eng.last_step.forward_s > 0
    parts = (st.step_wait_seconds_total + st.step_forward_seconds_total
             + st.step_sample_seconds_total + st.step_read_seconds_total)
    assert st.step_forward_seconds_total > 0 and st.step_sample_seconds_total > 0
    assert parts <= st.step_seconds.total
    steps = [r for r in caplog.records if r.getMessage().startswith("step of ")]
    assert len(steps) == st.steps_total and "forward" in steps[0].getMessage()


def test_the_breakdown_is_in_the_metrics() -> None:
    batcher = _run(Engine(CFG), 2, 4)
    names = {s.name for fam in StatsCollector("kvserve_decode", {"batch": lambda: batcher.stats})
             .collect() for s in fam.samples}
    for part in ("wait", "forward", "sample", "read", "chunk"):
        assert f"kvserve_decode_batch_step_{part}_seconds_total" in names
    assert {"kvserve_decode_batch_step_seconds_sum", "kvserve_decode_batch_step_seconds_count",
            "kvserve_decode_batch_step_rows_total"} <= names
