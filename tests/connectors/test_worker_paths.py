"""Issue 20: the connector's worker paths against a real kvstore, without a vLLM
server: saves gather blocks out of paged per-layer caches; synchronous and
asynchronous loads put them into other blocks bit for bit — on CPU straight from
the store's shared memory into each layer's cache, or through a leased host
buffer and a scatter where some layer has no block (a sliding window's null
block) — a missing block and everything after it are reported (the missing one
never written), and leased buffers are reused. On CPU always; on CUDA (pinned
buffers, the side stream, the events) where a GPU is present (marker ``gpu``)."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_buffers import HostBuffers
from connectors.vllm_loads import LoadSide
from connectors.vllm_meta import BlockTransfer
from connectors.vllm_saves import SaveSide
from kvstore.types import RequestCtx
from tests.connectors.stack import operator_security

LAYERS, BLOCKS, SHAPE = 4, 24, (2, 64, 16)       # [kv_heads, tokens, K|V] per layer block
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
LAYOUT = f"L{LAYERS}xH{SHAPE[0]}xT{SHAPE[1]}xD{SHAPE[2] // 2}:float32"

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device")])]


def _caches(device: str, fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: (torch.randn((BLOCKS, *SHAPE), generator=g) if fill
                else torch.zeros((BLOCKS, *SHAPE))).to(device) for n in NAMES}


def _counts() -> tuple[dict[str, int], object]:
    seen: dict[str, int] = {}

    def count(name: str, n: int = 1) -> None:
        seen[name] = seen.get(name, 0) + n
    return seen, count


def _until(cond, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_save_then_sync_and_async_loads_round_trip_bit_for_bit(vllm_stack, device: str) -> None:
    sec = operator_security()
    bridge = StoreBridge(vllm_stack.store.address, use_shm=True, retry_after_s=0.5,
                         security=sec)
    pinned = device == "cuda"
    buffers = HostBuffers((LAYERS, *SHAPE), torch.float32, pinned=pinned)
    seen, count = _counts()
    try:
        ctx = RequestCtx(request_id="r", tenant=f"worker-{vllm_stack.run}-{device}",
                         model_fingerprint="ab" * 16)
        keys = [os.urandom(16) for _ in range(4)]
        src = _caches(device, fill=True)
        saves = SaveSide(bridge, 30.0, SHAPE[1], count)
        saves.register(NAMES, (0,) * LAYERS, LAYOUT, torch.device(device), buffers)
        out = BlockTransfer("save-1", ctx, keys, [[3, 5, 7, 9]], 0)
        saves.bind([out])
        for n in NAMES:
            saves.save_layer([out], n, src[n])
        saves.wait_for_save()
        _until(lambda: saves.finished({"save-1"}) == {"save-1"}, "the Put")
        assert seen.get("saved_blocks") == 4

        # Synchronous: two requests in one step, one scatter per layer for both.
        dst = _caches(device, fill=False)
        loads = LoadSide(bridge, 10.0, count)
        loads.register(dst, NAMES, (0,) * LAYERS, buffers)
        made = buffers.allocated
        a = BlockTransfer("load-a", ctx, keys[:2], [[10, 11]], 0)
        b = BlockTransfer("load-b", ctx, keys, [[12, 13, 14, 15]], 0)
        loads.start([a, b], [])
        loads.wait_layer(NAMES[0])
        loads.end_step()
        for n in NAMES:
            assert torch.equal(dst[n][10:12].cpu(), src[n][[3, 5]].cpu())
            assert torch.equal(dst[n][12:16].cpu(), src[n][[3, 5, 7, 9]].cpu())
        assert loads.errors() == set() and seen.get("loaded_blocks") == 6

        # A null block id (no slot in that layer): through a leased buffer and a
        # scatter that skips it; the second time the same buffer serves.
        for _ in range(2):
            e = BlockTransfer("load-e", ctx, keys[:2], [[20, 0]], 0)
            loads.start([e], [])
            loads.wait_layer(NAMES[0])
            loads.end_step()
            for n in NAMES:
                assert torch.equal(dst[n][20].cpu(), src[n][3].cpu())
                assert not dst[n][0].any()                         # the null block
        assert loads.errors() == set()
        assert buffers.allocated == made         # the save's buffer served both

        # Asynchronous, with a key the warehouse never had in the middle: the
        # blocks before it land; it and every later one are reported (vLLM
        # recomputes them), the missing one never written.
        c = BlockTransfer("load-c", ctx, [keys[0], os.urandom(16), keys[2]], [[16, 17, 18]], 0)
        loads.start([], [c])
        done: set[str] = set()
        _until(lambda: bool(done.update(loads.finished()[0]) or done), "the async load")
        assert done == {"load-c"}
        assert loads.errors() == {17, 18}
        for n in NAMES:
            assert torch.equal(dst[n][16].cpu(), src[n][3].cpu())
            assert not dst[n][17].any()                            # nothing to write
        assert seen.get("load_errors") == 2 and seen.get("loads_async") == 1
        loads.close()
    finally:
        bridge.close()


def test_host_buffers_lease_by_capacity_and_stay_bounded() -> None:
    pool = HostBuffers((2, 3), torch.float32, pinned=False, keep=2)
    one = pool.take(5)
    assert one.view.shape == (5, 2, 3) and one.base.shape[0] == 8
    pool.give(one)
    again = pool.take(3)
    assert again.base.data_ptr() == one.base.data_ptr() and pool.allocated == 1
    big = pool.take(20)
    assert big.base.shape[0] == 32 and pool.allocated == 2
    huge = pool.take(50)
    for lease in (again, big, huge):
        pool.give(lease)
    assert pool.idle == 2                                   # the smallest was dropped
    assert pool.take(40).base.data_ptr() == huge.base.data_ptr()
    with pytest.raises(ValueError):
        pool.take(0)


@pytest.mark.parametrize("use_shm", [True, False])
def test_a_get_writes_each_block_into_its_pieces_in_order(vllm_stack, use_shm: bool) -> None:
    """The client's Get with per-block destinations in pieces (what the connector
    hands it on CPU), over shared memory and over the socket, verified both ways."""
    import asyncio

    from kvstore.client import KVStoreClient

    ctx = RequestCtx(request_id="pieces", tenant=f"pieces-{vllm_stack.run}",
                     model_fingerprint="ab" * 16)
    keys = [os.urandom(16) for _ in range(2)]
    blocks = [os.urandom(4096) for _ in range(2)]
    cuts = [(0, 1000), (1000, 1024), (1024, 4096)]           # uneven pieces

    async def body() -> list[bytes]:
        async with KVStoreClient(vllm_stack.store.address, use_shm=use_shm, timeout_s=10,
                                 security=operator_security()) as c:
            await c.put(keys, blocks, layout="L1xH1xT64xD8:float32", token_count=64, ctx=ctx)
            outs = [[memoryview(bytearray(b - a)) for a, b in cuts] for _ in keys]
            res = await c.get(keys, ctx=ctx, out=outs)
            assert res.hit_prefix == 2 and res.bytes == 8192
            return [b"".join(bytes(v) for v in o) for o in outs]

    assert asyncio.run(body()) == blocks
