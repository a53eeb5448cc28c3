"""A finished prompt stays resident in the prefill engine until decode pulls
it (real gRPC, a real engine): the pull copies out only the tail decode asks
for, an unpulled one is copied out whole after ``resident_s`` or as soon as
its blocks are needed, and every path frees its sequence."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
import torch

from common.config import ConfigError, PrefillSection
from engine import Engine
from prefill_svc.config import PrefillConfig
from prefill_svc.server import PrefillService
from proto import prefill_pb2, prefill_pb2_grpc
from service.config import Endpoint, EngineSpec
from service.kv_buffer import KVAssembler, KVPiece, KVShape
from tests.prefill_svc.inproc import serve_prefill

SPEC = EngineSpec(model="tiny-dense", block_tokens=16, num_blocks=256)
Served = tuple[prefill_pb2_grpc.PrefillStub, PrefillService]


@asynccontextmanager
async def serving(spec: EngineSpec = SPEC, **sched: object) -> AsyncIterator[Served]:
    config = PrefillConfig(engine=spec, endpoint=Endpoint(port=0),
                           scheduler=PrefillSection(**sched))  # type: ignore[arg-type]
    async with serve_prefill(config) as served:
        yield served


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 90))


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


def _want(tokens: list[int]) -> torch.Tensor:
    ref = Engine(SPEC.engine_config())
    ref.prefill("x", tokens)
    return ref.export_tokens("x", 0, len(tokens))


async def _pull(stub: prefill_pb2_grpc.PrefillStub, h: prefill_pb2.KVHandle, want: torch.Tensor,
                start: int = 0, *, use_shm: bool = False) -> torch.Tensor:
    asm = KVAssembler(KVShape.of(want), len(h.prompt_ids), seed=h.kv_seed, first=start)
    async for c in stub.PullKV(prefill_pb2.PullKVRequest(
            request_id=h.ctx.request_id, start_token=start, use_shm=use_shm), timeout=30):
        asm.add(KVPiece(c.start_token, c.token_count, c.data, c.shm_name, c.shm_offset,
                        c.size, c.checksum))
    return asm.done()


async def _idle(svc: PrefillService) -> None:
    await svc.thread.call(lambda: None)     # every engine job queued before has run


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_next_turn_copies_out_only_the_tail_decode_lacks(use_shm: bool) -> None:
    """Turn two of a session: decode holds the first 64 tokens, so only the
    other 46 leave the engine (the old hand-off copied all 110 out at the end
    of the prompt); the earlier tokens are refused afterwards (decode rebuilds)."""
    first, nxt = _tokens(1, 70), _tokens(1, 70) + _tokens(2, 40)
    want1, want2 = _want(first), _want(nxt)
    per_token = KVShape.of(want1).token_nbytes

    async def body() -> None:
        async with serving(resident_s=60.0) as (stub, svc):
            h1 = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=first), timeout=30)
            await _idle(svc)
            assert svc.stats.resident == 1 and svc.buffer.bytes == 0
            assert svc.stats.handoff_bytes_total == 0
            assert torch.equal(await _pull(stub, h1, want1, use_shm=use_shm), want1)
            assert svc.stats.handoff_bytes_total == 70 * per_token
            h2 = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=nxt), timeout=30)
            assert h2.cached_tokens == 64
            got = await _pull(stub, h2, want2, 64, use_shm=use_shm)
            assert torch.equal(got, want2[:, :, :, 64:, :])
            assert svc.stats.handoff_bytes_total == (70 + 46) * per_token
            assert svc.buffer.bytes == (70 + 46) * per_token
            s = svc.stats
            assert (s.handoff_materialized_total, s.handoff_demoted_total) == (2, 0)
            assert s.resident == 0 and not svc.engine.live_sequences
            # Where the pulls' time went on this side (the hold covers the copy-out).
            assert 0 < s.handoff_copy_seconds_total <= s.pull_hold_seconds_total
            assert (s.pull_shm_seconds_total > 0) == use_shm
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _pull(stub, h2, want2, 0)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "held from token 64 on only" in info.value.details()
            for h in (h1, h2):
                assert (await stub.Release(prefill_pb2.ReleaseRequest(
                    request_id=h.ctx.request_id), timeout=5)).released
            assert svc.buffer.bytes == 0

    run(body)


def test_an_unpulled_prompt_is_copied_out_whole_after_resident_s() -> None:
    """Not pulled within ``resident_s``: the next step job copies it out whole
    and frees it; its pull then serves the host copy exactly, from any start."""
    a, b = _tokens(3, 50), _tokens(4, 30)
    want = _want(a)

    async def body() -> None:
        async with serving(resident_s=0.05) as (stub, svc):
            ha = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=30)
            await asyncio.sleep(0.1)
            hb = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=b), timeout=30)
            await _idle(svc)
            assert svc.stats.handoff_demoted_total == 1
            assert svc.stats.handoff_bytes_total == want.numel() * want.element_size()
            assert svc.engine.live_sequences == [hb.ctx.request_id]     # b: still resident
            assert torch.equal(await _pull(stub, ha, want, 20), want[:, :, :, 20:, :])
            assert torch.equal(await _pull(stub, ha, want, 0, use_shm=True), want)
            assert svc.stats.handoff_materialized_total == 0

    run(body)


def test_residents_never_starve_an_admission() -> None:
    """A pool that holds one resident prompt or the next, not both: the next is
    admitted once the resident is copied out whole, which still pulls exactly."""
    small = EngineSpec(model="tiny-dense", block_tokens=16, num_blocks=10)
    a, b = _tokens(5, 100), _tokens(6, 100)             # 7 blocks each
    want = _want(a)

    async def body() -> None:
        async with serving(small, resident_s=600.0) as (stub, svc):
            ha = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=30)
            hb = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=b), timeout=30)
            assert hb.first_token and svc.stats.handoff_demoted_total == 1
            assert torch.equal(await _pull(stub, ha, want), want)
            assert (await stub.Release(prefill_pb2.ReleaseRequest(
                request_id=hb.ctx.request_id), timeout=5)).released
            await _idle(svc)
            assert not svc.engine.live_sequences and svc.stats.resident == 0

    run(body)


def test_a_resend_shares_the_blocks_of_a_prompt_still_resident() -> None:
    """G1 has a finished prompt's blocks at once, while its sequence is still
    held: the next turn reuses them, and both pulls give the reference KV."""
    a = _tokens(9, 70)
    b = a + _tokens(10, 30)
    want_a, want_b = _want(a), _want(b)

    async def body() -> None:
        async with serving(resident_s=600.0) as (stub, svc):
            ha = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=30)
            hb = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=b), timeout=30)
            await _idle(svc)                # the reply leaves before its step job ends
            assert hb.cached_tokens == 64 and svc.stats.resident == 2
            assert torch.equal(await _pull(stub, hb, want_b, 16), want_b[:, :, :, 16:, :])
            assert torch.equal(await _pull(stub, ha, want_a), want_a)
            await _idle(svc)
            assert not svc.engine.live_sequences and svc.stats.handoff_demoted_total == 0

    run(body)


def test_release_and_shutdown_free_resident_prompts() -> None:
    async def body() -> None:
        async with serving(resident_s=600.0) as (stub, svc):
            ha = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=_tokens(7, 40)),
                                    timeout=30)
            await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=_tokens(8, 40)), timeout=30)
            await _idle(svc)
            assert len(svc.engine.live_sequences) == 2
            assert (await stub.Release(prefill_pb2.ReleaseRequest(
                request_id=ha.ctx.request_id), timeout=5)).released
            await _idle(svc)
            assert len(svc.engine.live_sequences) == 1 and svc.stats.handoff_bytes_total == 0
            engine = svc.engine
        assert not engine.live_sequences            # shutdown freed the other one

    run(body)


@pytest.mark.parametrize("yield_s", [10.0, 0.0])
def test_a_pull_waits_for_the_step_in_flight_when_it_sends_first_tokens(yield_s: float) -> None:
    """On a CPU a finished prompt's pull copies its whole KV on the cores the
    next step needs (a long context's resends, issue 18): it starts once a step
    in flight that completes prompts has ended, waiting ``copy_yield_s`` at
    most (0: at once). The engine thread is held here, so that step cannot end
    until the test lets it."""
    a, b = _tokens(11, 50), _tokens(12, 40)
    want = _want(a)

    async def body() -> None:
        async with serving(resident_s=600.0, copy_yield_s=yield_s) as (stub, svc):
            ha = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=30)
            await _idle(svc)
            gate = threading.Event()
            svc.thread.submit(gate.wait, 30)            # b's step queues behind it
            try:
                hb = asyncio.ensure_future(stub.Prefill(
                    prefill_pb2.PrefillRequest(token_ids=b), timeout=30))
                for _ in range(500):
                    if svc.steps.finishing or (yield_s == 0 and svc.stats.queue_waiting):
                        break
                    await asyncio.sleep(0.01)
                assert svc.steps.finishing == (yield_s > 0)
                pull = asyncio.create_task(_pull(stub, ha, want))
                await asyncio.sleep(0.5)
                if yield_s > 0:
                    assert not pull.done() and svc.stats.handoff_materialized_total == 0
                else:                                   # copied beside the held step
                    assert torch.equal(await asyncio.wait_for(pull, 10), want)
            finally:
                gate.set()
            assert (await hb).first_token
            assert torch.equal(await pull, want)
            assert (svc.stats.copy_yield_seconds_total >= 0.4) == (yield_s > 0)
            assert not svc.steps.finishing

    run(body)


def test_resident_s_and_copy_yield_s_are_validated() -> None:
    assert PrefillSection().resident_s == 0.5
    with pytest.raises(ConfigError, match="resident_s"):
        PrefillSection(resident_s=-1.0)
    assert PrefillSection().copy_yield_s == 2.0
    with pytest.raises(ConfigError, match="copy_yield_s"):
        PrefillSection(copy_yield_s=-0.1)


def test_resident_prompts_hold_their_blocks_but_no_mirrors() -> None:
    """A resident prompt is only copied out of the pool later, so it keeps its
    blocks and drops its mirror (1.5x its KV outside the pool): with 12
    sessions' contexts resident, the prefill process on the H200 held 56 GiB
    (issue 18 run 4). The pull still returns the same KV."""
    prompts = [_tokens(10 + i, 60 + 13 * i) for i in range(4)]
    wants = [_want(p) for p in prompts]

    async def body() -> None:
        async with serving(resident_s=60.0) as (stub, svc):
            handles = [await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=p), timeout=30)
                       for p in prompts]
            await _idle(svc)
            assert svc.stats.resident == len(prompts)
            assert svc.engine.memory().mirror_bytes == 0
            for h, want in zip(handles, wants, strict=True):
                assert torch.equal(await _pull(stub, h, want), want)
            await _idle(svc)
            assert svc.stats.resident == 0 and svc.engine.live_sequences == []

    run(body)
