"""A rebuild on decode (a prompt whose KV is computed here) goes in chunks
between decode steps (decode_svc/batcher.py): the sequences already decoding
get a token per chunk instead of waiting for the whole prompt, and both
answers equal the engine's alone."""

from __future__ import annotations

import asyncio
from typing import Any

from decode_svc.batcher import Batcher
from engine import Engine, EngineConfig, SamplingParams
from service.engine_thread import EngineThread

CFG = EngineConfig(model="tiny-dense", block_tokens=16, num_blocks=512)
CHUNK = 64


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 11) % 250 + 1 for i in range(n)]


def test_long_rebuild_stalls_others_by_one_chunk_per_step() -> None:
    ref = Engine(CFG)
    a_prompt, b_prompt = _prompt(1, 40), _prompt(2, 900)
    sp_a = SamplingParams(max_tokens=60, ignore_eos=True)
    sp_b = SamplingParams(max_tokens=8, ignore_eos=True)
    want_a = ref.generate(a_prompt, sp_a).tokens
    want_b = ref.generate(b_prompt, sp_b).tokens
    eng = Engine(CFG)
    log: list[tuple[str, Any]] = []     # appended on the loop, and once on the engine thread

    async def run(batcher: Batcher, seq_id: str, make_live: Any, n: int) -> list[int]:
        out: list[int] = []
        blocks = eng.kv_blocks_for(n, 60)
        async for ev in batcher.generate(seq_id, make_live, prompt_tokens=n, kv_blocks=blocks):
            out += ev.token_ids
            log.append((seq_id, ev))
        return out

    def rebuild() -> None:              # what decode_svc/server.py's rebuild does
        log.append(("b-admitted", None))
        eng.admit("b", b_prompt, sampling=sp_b, first_token=want_b[0])

    async def body() -> tuple[list[int], list[int], Batcher, list[str]]:
        thread = EngineThread("test-decode")
        batcher = Batcher(eng, thread, max_seqs=4, rebuild_chunk=CHUNK)
        batcher.start()
        try:
            a = asyncio.create_task(run(batcher, "a", lambda: eng.prefill(
                "a", a_prompt, sampling=sp_a), len(a_prompt)))
            while sum(who == "a" for who, _ in log) < 2:
                await asyncio.sleep(0.001)
            b = asyncio.create_task(run(batcher, "b", rebuild, len(b_prompt)))
            got_a, got_b = await asyncio.gather(a, b)
            live = await thread.call(lambda: eng.live_sequences)   # frees queued before it
            return got_a, got_b, batcher, live
        finally:
            await batcher.close()
            thread.close()

    got_a, got_b, batcher, live = asyncio.run(asyncio.wait_for(body(), 120))
    assert got_a == want_a and got_b == want_b
    start = next(i for i, (who, _) in enumerate(log) if who == "b-admitted")
    first_b = next(i for i, (who, _) in enumerate(log) if who == "b")
    a_during = sum(who == "a" for who, _ in log[start:first_b])
    chunks = -(-len(b_prompt) // CHUNK)
    # One decode step of "a" rides with every chunk of "b" (the step of the chunk
    # that completes "b" may land just after b's first event).
    assert a_during >= chunks - 1, (a_during, chunks)
    assert batcher.stats.rebuild_chunks_total == chunks
    assert live == []


def test_a_rebuild_whose_caller_leaves_is_freed_between_chunks() -> None:
    eng = Engine(CFG)
    prompt = _prompt(3, 900)

    async def body() -> Batcher:
        thread = EngineThread("test-decode")
        batcher = Batcher(eng, thread, max_seqs=2, rebuild_chunk=16)
        batcher.start()
        try:
            gen = batcher.generate("c", lambda: eng.admit("c", prompt, first_token=5),
                                   prompt_tokens=len(prompt),
                                   kv_blocks=eng.kv_blocks_for(len(prompt), 16))
            task = asyncio.create_task(gen.__anext__())
            while batcher.stats.rebuild_chunks_total < 3:
                await asyncio.sleep(0.001)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()
            assert await thread.call(lambda: eng.live_sequences) == []
            return batcher
        finally:
            await batcher.close()
            thread.close()

    batcher = asyncio.run(asyncio.wait_for(body(), 120))
    assert batcher.stats.cancelled_total == 1
    assert batcher.stats.rebuild_chunks_total < -(-len(prompt) // 16)


def test_a_tail_computed_alone_counts_its_chunk_time() -> None:
    """A prompt computed with nothing decoding beside it (a returning turn's
    tail on an idle instance) still shows its chunk's time in the step
    counters: that is most of such a request's first token."""
    eng = Engine(CFG)
    prompt = _prompt(3, 100)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    want = Engine(CFG).generate(prompt, sp).tokens

    async def body() -> tuple[list[int], Batcher]:
        thread = EngineThread("test-decode")
        batcher = Batcher(eng, thread, max_seqs=2, rebuild_chunk=CHUNK)
        batcher.start()
        try:
            got: list[int] = []
            async for ev in batcher.generate(
                    "t", lambda: eng.admit("t", prompt, sampling=sp), prompt_tokens=len(prompt),
                    kv_blocks=eng.kv_blocks_for(len(prompt), 1)):
                got += ev.token_ids
            return got, batcher
        finally:
            await batcher.close()
            thread.close()

    got, batcher = asyncio.run(body())
    assert got == want
    assert batcher.stats.steps_total == 0                  # no decode row was ever stepped
    assert batcher.stats.rebuild_chunks_total == -(-len(prompt) // CHUNK)
    assert batcher.stats.step_chunk_seconds_total > 0.0
