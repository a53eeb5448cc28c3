"""Decode admits a sequence only with the KV blocks it can grow to reserved
(decode_svc/kv_gate.py). Before, a small decode pool took several long
prompts into batch slots, and the pool ran out mid-answer: the whole decode
step failed (PoolExhaustedError) for every sequence in it, after their first
tokens had gone out, and later ones failed in adopt. Now they wait in decode's
bounded queue and all complete; one that could never fit is refused up front."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from decode_svc.batcher import Batcher
from decode_svc.prefix_hold import PrefixHolds
from engine import Engine, EngineConfig, SamplingParams
from proto import prefill_pb2
from service.engine_thread import EngineThread
from tests.decode_svc.stack import TIMEOUT, Stack, decode, prefill, prompt, reference
from tests.prefill_svc import procs

POOL = 40                               # blocks of 16 tokens: two of the sequences below
PROMPT, MAX = 200, 100                  # 299 tokens of KV at most: 19 blocks each
KV = "kvserve_decode_kv_"


@pytest.fixture(scope="module")
def small_pool_decode(stack: Stack) -> Iterator[procs.Proc]:
    p = procs.engine_service("decode", stack.config, stack.redis_url, stack.log_dir,
                             store_address=stack.store.address,
                             extra=("--num-blocks", str(POOL), "--max-seqs", "8"))
    procs.start_all(p)
    try:
        yield p
    finally:
        p.stop()


def _settled(proc: procs.Proc) -> dict[str, float]:
    """Metrics once every reservation is back (the last ones return right
    after their final events, when the canonical write has freed them)."""
    deadline = time.monotonic() + 10
    while True:
        m = proc.metrics()
        if m[f"{KV}reserved_blocks"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def test_long_prompts_beyond_the_pool_wait_for_blocks_and_all_complete(
        stack: Stack, small_pool_decode: procs.Proc) -> None:
    need = stack.ref.kv_blocks_for(PROMPT, MAX, canonical=True)
    assert 2 * need <= POOL < 3 * need                  # the pool, not the 8 slots, limits
    prompts = [prompt(200 + i, PROMPT) for i in range(6)]
    want = [reference(stack.ref, p, MAX, ignore_eos=True) for p in prompts]
    pre, dec = stack.prefill_stub(), stack.decode_stub(small_pool_decode.address)
    handles = [prefill(pre, p, max_tokens=MAX, ignore_eos=True) for p in prompts]
    with ThreadPoolExecutor(len(handles)) as pool:
        got = list(pool.map(lambda h: decode(dec, h, max_tokens=MAX, ignore_eos=True),
                            handles))
    assert [g.tokens for g in got] == want                # each as if it ran alone
    assert {g.finish_reason for g in got} == {"length"}
    m = _settled(small_pool_decode)
    assert m[f"{KV}waits_total"] >= 1                     # some really waited for blocks
    assert m[f"{KV}reserved_blocks"] == 0 and m[f"{KV}capacity_blocks"] == POOL
    assert m[f"{KV}pool_free_blocks"] == POOL             # every block came back
    assert m["kvserve_decode_batch_cancelled_total"] == 0
    assert m.get("kvserve_decode_decode_requests_total{kind=length}") == 6


def test_a_sequence_bigger_than_the_whole_pool_is_refused_up_front(
        stack: Stack, small_pool_decode: procs.Proc) -> None:
    q = prompt(300, 600)
    need = stack.ref.kv_blocks_for(len(q), MAX, canonical=True)
    assert need > POOL
    pre, dec = stack.prefill_stub(), stack.decode_stub(small_pool_decode.address)
    h = prefill(pre, q, max_tokens=MAX)
    with pytest.raises(grpc.RpcError) as info:
        decode(dec, h, max_tokens=MAX)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT       # not worth retrying anywhere
    assert f"needs {need} KV blocks" in err.details()
    assert f"holds {POOL} blocks" in err.details()
    m = small_pool_decode.metrics()
    assert m["kvserve_decode_decode_kv_too_large_total"] == 1
    assert m["kvserve_decode_decode_in_service"] == 0
    # Refused before any work: the KV is still where prefill left it.
    kv = list(pre.PullKV(prefill_pb2.PullKVRequest(request_id=h.ctx.request_id),
                         timeout=TIMEOUT))
    assert sum(c.token_count for c in kv) == len(q)
    # A smaller answer of the same prompt fits, and is right.
    small = stack.ref.kv_blocks_for(len(q), 8, canonical=True)
    assert small <= POOL
    assert decode(dec, h, max_tokens=8).tokens == reference(stack.ref, q, 8)


CFG = EngineConfig(model="tiny-dense", block_tokens=16, num_blocks=POOL)


def test_cancelled_callers_give_their_reservations_back() -> None:
    """The engine thread is held by a job of the test while callers queue and
    leave, so what is reserved at each moment is exact, not a race."""
    eng = Engine(CFG)
    a_prompt, c_prompt = prompt(400, 20), prompt(402, PROMPT)
    sp_a = SamplingParams(max_tokens=600, ignore_eos=True)       # 39 blocks: the whole pool
    sp_c = SamplingParams(max_tokens=MAX, ignore_eos=True)
    want_c = Engine(CFG).generate(c_prompt, sp_c).tokens
    a_need, c_need = eng.kv_blocks_for(20, 600), eng.kv_blocks_for(PROMPT, MAX)
    assert a_need + c_need > POOL

    async def drain(gen: Any) -> list[int]:
        return [t async for ev in gen for t in ev.token_ids]

    async def body() -> tuple[list[int], list[str], int]:
        thread = EngineThread("test-decode")
        batcher = Batcher(eng, thread, max_seqs=4)
        batcher.start()
        hold = threading.Event()
        try:
            a = batcher.generate("a", lambda: eng.prefill("a", a_prompt, sampling=sp_a),
                                 prompt_tokens=20, kv_blocks=a_need)
            await a.__anext__()                           # a decodes, holding 39 blocks
            thread.submit(hold.wait)                      # no step runs until released
            b = asyncio.create_task(drain(batcher.generate(
                "b", lambda: eng.prefill("b", c_prompt, sampling=sp_c),
                prompt_tokens=PROMPT, kv_blocks=c_need)))
            c = asyncio.create_task(drain(batcher.generate(
                "c", lambda: eng.prefill("c", c_prompt, sampling=sp_c),
                prompt_tokens=PROMPT, kv_blocks=c_need)))
            while batcher.gate.waiting < 2:
                await asyncio.sleep(0.001)
            assert batcher.kv_stats().reserved_blocks == a_need
            b.cancel()                                    # leaves while queued
            await asyncio.gather(b, return_exceptions=True)
            st = batcher.kv_stats()
            assert (st.waiting, st.reserved_blocks) == (1, a_need)
            await a.aclose()                              # leaves while decoding
            st = batcher.kv_stats()
            assert (st.waiting, st.reserved_blocks) == (0, c_need)   # c took a's room
            hold.set()
            got_c = await c
            live = await thread.call(lambda: eng.live_sequences)
            return got_c, live, batcher.kv_stats().reserved_blocks
        finally:
            hold.set()
            await batcher.close()
            thread.close()

    got_c, live, reserved = asyncio.run(asyncio.wait_for(body(), 60))
    assert got_c == want_c
    assert live == [] and reserved == 0 and eng.free_blocks == POOL


def test_a_g1_prefix_held_for_a_call_is_reserved_then_handed_on_or_given_back() -> None:
    """Decode pins the prefix its own G1 holds while a call pulls the rest: the
    pins are reserved in the gate first (so nothing promised to others is lost),
    the reservation joins the call's grant, the adopt takes the pins, and every
    other path gives both back exactly once."""
    eng = Engine(CFG)
    B = CFG.block_tokens
    base = prompt(410, 5 * B)
    keys = [bytes([i]) * 16 for i in range(5)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.prefill("x", base)
    eng.free("x", keep_keys=keys)                         # 5 blocks idle in G1
    nxt = base + prompt(411, 7)
    kv = Engine(CFG)
    kv.prefill("k", nxt, sampling=sp)
    whole = kv.export_tokens("k", 0, len(nxt))
    want = kv.generate(nxt, sp).tokens
    need = eng.kv_blocks_for(len(nxt), sp.max_tokens)

    async def body() -> None:
        thread = EngineThread("test-decode")
        batcher = Batcher(eng, thread, max_seqs=4)
        holds = PrefixHolds(eng, thread, batcher.gate)
        batcher.start()
        try:
            h = await holds.hold(keys, len(nxt))          # given back unused
            assert h is not None and len(h.blocks) == 5 and batcher.gate.reserved == 5
            assert eng.free_blocks == POOL - 5
            holds.release(h)
            holds.release(h)                              # idempotent
            await thread.call(lambda: None)
            assert batcher.gate.reserved == 0 and eng.free_blocks == POOL
            assert batcher.gate.reserve_now(POOL - 2)     # no room: nothing pinned
            assert await holds.hold(keys, len(nxt)) is None
            assert eng.free_blocks == POOL
            batcher.gate.release_blocks(POOL - 2)
            h = await holds.hold(keys, len(nxt))          # adopted: pins are the sequence's
            assert h is not None
            tail = whole[:, :, :, h.tokens(B):, :]

            def adopt() -> None:
                eng.adopt("d", nxt, tail, want[0], sp, prefix=h.blocks)
                h.adopted = True

            got = [t async for ev in batcher.generate("d", adopt, prompt_tokens=len(nxt),
                                                     kv_blocks=need, held_blocks=h.hand_over())
                   for t in ev.token_ids]
            holds.release(h)
            await thread.call(lambda: None)
            assert got == want
            assert batcher.gate.reserved == 0 and eng.free_blocks == POOL
            assert all(eng.blocks.ref_count(b) == 0 for b in range(POOL))
            h = await holds.hold(keys, len(nxt))          # the call leaves while queued
            assert h is not None
            assert batcher.gate.reserve_now(POOL - 5)
            gen = asyncio.create_task(batcher.generate(
                "e", adopt, prompt_tokens=len(nxt), kv_blocks=need,
                held_blocks=h.hand_over()).__anext__())
            while batcher.gate.waiting < 1:
                await asyncio.sleep(0.001)
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
            holds.release(h)
            await thread.call(lambda: None)
            assert batcher.gate.reserved == POOL - 5 and eng.free_blocks == POOL
        finally:
            await batcher.close()
            thread.close()

    asyncio.run(asyncio.wait_for(body(), 60))
