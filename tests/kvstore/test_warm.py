"""Session warm-up over gRPC: ``Warm`` moves a chain's usable blocks from G3 up
into G2 (verified reads), leaves G2 blocks alone, and counts what it did."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvstore.client import KVStoreClient
from kvstore.service import start_server
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse
from tests.kvstore.storeproc import BLOCK_BYTES, LAYOUT, blocks, keys, wh_config

CTX = RequestCtx(tenant="acme")
BT = 4                                            # tokens per block in these tests


def test_warm_promotes_g3_blocks_into_g2(redis_url: str, tmp_path: Path) -> None:
    async def body() -> None:
        # G2 holds 4 blocks; 12 are put, so the first ones end up in G3 only.
        wh = await Warehouse(wh_config(redis_url, tmp_path / "g3",
                                       g2_bytes=4 * BLOCK_BYTES)).start()
        srv = await start_server(wh)
        try:
            ks, payloads = keys(12, seed=5), blocks(12, seed=5)
            async with KVStoreClient(f"127.0.0.1:{srv.port}", use_shm=False) as c:
                await c.put(ks, payloads, layout=LAYOUT, token_count=BT, ctx=CTX)
                await wh.flush()
                before = await c.lookup(ks, prompt_tokens=12 * BT + 1, ctx=CTX, touch=False)
                cold = [i for i, t in enumerate(before.block_tiers[:4]) if t == "G3"]
                assert cold, f"expected G3-only blocks at the front, got {before.block_tiers}"
                # Warm the first 4 blocks' chain (a prompt of 4 blocks + 1 token).
                res = await c.warm(ks[:4], prompt_tokens=4 * BT + 1, ctx=CTX)
                assert res.matched_blocks == 4
                assert res.promoted_blocks == len(cold)
                assert res.in_g2_blocks == 4 - len(cold)
                after = await c.lookup(ks[:4], prompt_tokens=4 * BT + 1, ctx=CTX, touch=False)
                assert after.block_tiers == ["G2"] * 4
                again = await c.warm(ks[:4], prompt_tokens=4 * BT + 1, ctx=CTX)
                assert (again.promoted_blocks, again.in_g2_blocks) == (0, 4)
                # What comes back is the bytes that were put (verified on the way).
                got = await c.get(ks[:4], ctx=CTX)
                assert [bytes(g) for g in got.payloads if g is not None] == [
                    bytes(p) for p in payloads[:4]]
                # Another tenant's warm finds nothing of acme's.
                other = await c.warm(ks[:4], prompt_tokens=4 * BT + 1,
                                     ctx=RequestCtx(tenant="bob"))
                assert other.matched_blocks == 0 and other.promoted_blocks == 0
        finally:
            await srv.server.stop(0)
            await wh.close()

    asyncio.run(body())
