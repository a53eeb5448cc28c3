"""``kvserve bench store`` rows for Put acknowledgement (issue 10, item 7): the same
blocks put into one ``kvserve store serve`` process (G2 + a G3 directory, fsync on)
under a class acknowledged at G2 (``agent``, the default ``ack = "g2"``) and a class
acknowledged once durable (``chat``, ``ack = "durable"``), in turn within every
round. Between rounds the store's background G3 writes are left to drain, so
neither class's time includes the other's disk work.

Rows: ack_g2_put_gbps, ack_durable_put_gbps (best of repeats), and
ack_durable_vs_g2 = durable / g2 (the cost of waiting for the fsync).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.harness import Timing

ACK_CONFIG = """[blocks]
block_tokens = 1
[classes]
default = "agent"
[classes.ttl_s]
agent = 259200
chat = 604800
[classes.ack]
chat = "durable"
"""


async def _g3_blocks(c: Any) -> int:
    return next((t.blocks for t in (await c.stats()).tiers if t.tier == "G3"), 0)


@contextlib.asynccontextmanager
async def served_store(url: str, root: Path, *, g2_bytes: int, config: str, node: str,
                       g3: bool = True) -> AsyncIterator[Any]:
    """A ``kvstore serve`` process of its own (mTLS, the given config) and an
    operator's client of it, stopped after."""
    from kvstore.client import KVStoreClient
    from kvstore.redis_server import free_port
    from security.config import TLS_DIR_ENV, SecurityConfig
    from security.pki import ensure_deployment
    from security.secret_files import redis_url_args

    tls_tmp = tempfile.TemporaryDirectory(prefix=f"kvserve-{node}-")
    tls = os.environ.get(TLS_DIR_ENV) or str(ensure_deployment(tls_tmp.name))
    cfg = root / f"{node}.toml"
    cfg.write_text(config)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--metrics-port", "-1", *redis_url_args(url, tls_tmp.name),
        "--node", node, "--g2-bytes", str(g2_bytes),
        *(("--g3-path", str(root / f"{node}-g3")) if g3 else ()),
        "--config", str(cfg), "--tls-dir", tls,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        if not line.startswith("kvstore ready"):
            raise RuntimeError(f"store did not start: {line!r}")
        async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=300,
                                 security=SecurityConfig(tls, role="operator")) as c:
            yield c
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
        tls_tmp.cleanup()


async def bench_ack(arr: Any, repeats: int, url: str, root: Path) -> dict[str, float]:
    """``arr``: the benchmark's blocks, a uint8 array [n, block_bytes]."""
    from kvstore.types import RequestCtx

    n, size = arr.shape
    layout = f"L1xH1xT{size // 8}xD1:float32"                # 1*2*1*T*1*4 bytes = size
    samples: dict[str, list[float]] = {"g2": [], "durable": []}
    async with served_store(url, root, g2_bytes=2 * n * size * (repeats + 2), config=ACK_CONFIG,
                            node="bench-ack") as c:
        written = 0
        for r in range(repeats + 1):                        # round 0 warms both paths
            for mode, cls in (("g2", "agent"), ("durable", "chat")):
                ks = [b"A" + bytes([r, mode == "g2"]) + i.to_bytes(4, "little") + b"\0" * 9
                      for i in range(n)]
                ctx = RequestCtx(tenant="bench", traffic_class=cls)
                t0 = time.perf_counter()
                res = await c.put(ks, arr, layout=layout, token_count=1, ctx=ctx)
                dt = time.perf_counter() - t0
                if res.stored != n:
                    raise RuntimeError(f"ack bench: {n - res.stored} blocks not stored")
                if r:
                    samples[mode].append(dt)
                written += n
                deadline = time.monotonic() + 120            # let G3 catch up
                while await _g3_blocks(c) < written:
                    if time.monotonic() > deadline:
                        raise RuntimeError("ack bench: G3 writes did not drain")
                    await asyncio.sleep(0.05)
    total = n * size
    out = {f"ack_{m}_put_gbps": total / Timing(tuple(s)).min / 1e9 for m, s in samples.items()}
    out["ack_durable_vs_g2"] = out["ack_durable_put_gbps"] / out["ack_g2_put_gbps"]
    return out
