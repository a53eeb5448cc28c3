"""``kvserve bench store`` rows for one process's Puts at once (``--only lanes``):
the benchmark's blocks cut into 8 Puts (fewer for fewer blocks) sent together
by one client, as a decode instance puts the blocks of answers that end in the
same step, into one ``kvstore serve`` process over shared memory. The client stages them in
one segment (``put_lanes=1``: each Put waits for the one before it, the
client as it was) or in four (``put_lanes=4``, the default), in turn within
every round.

Rows: lanes1_put_gbps, lanes4_put_gbps (best of repeats), and
lanes4_vs_1 = four lanes / one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Timing
from benchmarks.store_ack import served_store

PUTS = 8
LANES = (1, 4)
CONFIG = "[blocks]\nblock_tokens = 1\n"


async def bench_lanes(arr: Any, repeats: int, url: str, root: Path) -> dict[str, float]:
    """``arr``: the benchmark's blocks, a uint8 array [n, block_bytes]."""
    from kvstore.client import KVStoreClient
    from kvstore.types import RequestCtx

    n, size = arr.shape
    puts = min(PUTS, n)
    layout = f"L1xH1xT{size // 8}xD1:float32"                # 1*2*1*T*1*4 bytes = size
    per = n // puts
    ctx = RequestCtx(tenant="bench")
    samples: dict[int, list[float]] = {k: [] for k in LANES}
    rounds = repeats + 1                                     # round 0 warms both
    async with served_store(url, root, g2_bytes=n * size * len(LANES) * (rounds + 1),
                            config=CONFIG, node="bench-lanes", g3=False) as op:
        clients = {k: KVStoreClient(op.address, timeout_s=300, security=op.security,
                                    put_lanes=k) for k in LANES}
        try:
            for r in range(rounds):
                for k, c in clients.items():
                    t0 = time.perf_counter()
                    res = await asyncio.gather(*(
                        c.put(_keys(r, k, j, per), arr[j * per:(j + 1) * per], layout=layout,
                              token_count=1, ctx=ctx) for j in range(puts)))
                    dt = time.perf_counter() - t0
                    if sum(x.stored for x in res) != puts * per:
                        raise RuntimeError("lanes bench: blocks not stored")
                    if r:
                        samples[k].append(dt)
        finally:
            for c in clients.values():
                await c.close()
    total = puts * per * size
    out = {f"lanes{k}_put_gbps": total / Timing(tuple(s)).min / 1e9 for k, s in samples.items()}
    out["lanes4_vs_1"] = out["lanes4_put_gbps"] / out["lanes1_put_gbps"]
    return out


def _keys(r: int, k: int, j: int, per: int) -> list[bytes]:
    """Fresh keys for round ``r``, lane count ``k``, Put ``j``."""
    return [b"L" + bytes([r, k, j]) + i.to_bytes(4, "little") + b"\0" * 8 for i in range(per)]
