"""``kvserve bench store``: the warehouse's data paths against raw baselines,
side by side in one run (same blocks, same machine, same moment).

Rows (GB/s unless noted; best of ``--repeats``, the same rule for every row):
- memcpy: numpy copy of the blocks into a reused buffer (the ceiling of any
  in-memory path); g2_put / g2_get: the G2 tier (copy + xxh3 checksum);
- raw_write / raw_read: one plain file per block, write + fsync, read back
  into a reused buffer; g3_write / g3_read: the G3 tier (temp file, fsync,
  rename, directory fsync; read + verify). Reads come from the page cache
  for both, as the files were just written;
- redis_put / redis_get: the blocks as Redis values, one SET/GET each (what
  LMCache's Redis backend does);
- lookup p50/p99 ms: one chain lookup of ``--chain`` blocks (loopback Redis,
  TTL refresh on), and grpc_lookup through the service;
- grpc_put / grpc_get: a ``kvserve store serve`` process over loopback TCP;
  shm_put / shm_get: the same process through shared memory. grpc_gbps and
  shm_gbps are the get figures (restoring KV is the path that waits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOALS = (
    ("g3_write_gbps", "raw_write_gbps", 0.9),
    ("g3_read_gbps", "raw_read_gbps", 0.9),
    ("shm_gbps", "memcpy_gbps", 0.9),
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-bytes", type=int, default=2 * 2**20, help="bytes per block")
    p.add_argument("--blocks", type=int, default=64, help="blocks per pass")
    p.add_argument("--repeats", type=int, default=3, help="passes per row (best is reported)")
    p.add_argument("--chain", type=int, default=2048, help="blocks per lookup chain")
    p.add_argument("--lookups", type=int, default=300, help="lookups timed")
    p.add_argument("--dir", default="", help="directory for disk rows (default: a temp dir)")
    p.add_argument("--redis-url", default="", help="Redis (default: an embedded server)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default="", help="also draw the throughput rows into this PNG")


def _best_gbps(nbytes: int, repeats: int, fn: Callable[[int], None]) -> float:
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class _Data:
    def __init__(self, n: int, size: int) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        self.arr = rng.integers(0, 256, (n, size), dtype=np.uint8)
        self.views = [memoryview(self.arr[i]) for i in range(n)]
        self.n, self.size, self.total = n, size, n * size

    def keys(self, tag: int) -> list[bytes]:
        return [tag.to_bytes(4, "little") + i.to_bytes(4, "little") + b"\x5a" * 8
                for i in range(self.n)]


def bench_memory(d: _Data, repeats: int) -> dict[str, float]:
    import numpy as np

    from kvstore.blockfile import BlockMeta
    from kvstore.tiers.host import HostTier

    dst = np.empty_like(d.arr)
    np.copyto(dst, d.arr)                                     # fault the destination in

    def memcpy(_: int) -> None:
        for i in range(d.n):
            np.copyto(dst[i], d.arr[i])

    out: dict[str, float] = {"memcpy_gbps": _best_gbps(d.total, repeats, memcpy)}
    g2 = HostTier("mem://bench", name="G2", capacity_bytes=d.total + 2**20, pin=False)
    try:
        prefault = getattr(g2, "prefault", None)
        if callable(prefault):
            prefault()

        def meta(k: bytes) -> BlockMeta:
            return BlockMeta(k, "", "", 1, "chat", time.time() + 3600)

        warm = d.keys(999)
        for k, v in zip(warm, d.views, strict=True):          # first touch of the arena
            g2.put(k, v, meta(k))
        last: list[bytes] = warm

        def put(r: int) -> None:
            nonlocal last
            for k in last:
                g2.delete(k)
            last = d.keys(r)
            for k, v in zip(last, d.views, strict=True):
                g2.put(k, v, meta(k))

        def get(_: int) -> None:
            for k in last:
                if g2.get(k) is None:
                    raise RuntimeError("G2 lost a block during the benchmark")

        out["g2_put_gbps"] = _best_gbps(d.total, repeats, put)
        out["g2_get_gbps"] = _best_gbps(d.total, repeats, get)
    finally:
        g2.close()
    return out


def bench_disk(d: _Data, repeats: int, root: Path) -> dict[str, float]:
    from kvstore.blockfile import BlockMeta
    from kvstore.tiers import open_tier

    raw_dir = root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    buf = bytearray(d.size)

    def raw_write(r: int) -> None:
        for i, v in enumerate(d.views):
            fd = os.open(raw_dir / f"{r}-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, v)
                os.fsync(fd)
            finally:
                os.close(fd)

    def raw_read(_: int) -> None:
        for i in range(d.n):
            with open(raw_dir / f"0-{i}", "rb", buffering=0) as f:
                f.readinto(buf)

    out = {"raw_write_gbps": _best_gbps(d.total, repeats, raw_write),
           "raw_read_gbps": _best_gbps(d.total, repeats, raw_read)}
    g3 = open_tier(str(root / "g3"), name="G3", capacity_bytes=100 * d.total)
    keys: list[list[bytes]] = []

    def g3_write(r: int) -> None:
        ks = d.keys(100 + r)
        keys.append(ks)
        for k, v in zip(ks, d.views, strict=True):
            g3.put(k, v, BlockMeta(k, "", "", 1, "chat", time.time() + 3600))

    def g3_read(_: int) -> None:
        for k in keys[0]:
            if g3.get(k) is None:
                raise RuntimeError("G3 lost a block during the benchmark")

    out["g3_write_gbps"] = _best_gbps(d.total, repeats, g3_write)
    out["g3_read_gbps"] = _best_gbps(d.total, repeats, g3_read)
    g3.close()
    return out


def bench_redis(d: _Data, repeats: int, url: str) -> dict[str, float]:
    import redis

    r = redis.Redis.from_url(url)
    ks = d.keys(7)

    def put(_: int) -> None:
        for k, v in zip(ks, d.views, strict=True):
            r.set(b"bench:" + k, v)

    def get(_: int) -> None:
        for k in ks:
            if r.get(b"bench:" + k) is None:
                raise RuntimeError("Redis lost a value")

    out = {"redis_put_gbps": _best_gbps(d.total, repeats, put),
           "redis_get_gbps": _best_gbps(d.total, repeats, get)}
    r.delete(*[b"bench:" + k for k in ks])
    r.close()
    return out


def _percentiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return statistics.median(times) * 1e3, p99 * 1e3


async def bench_lookup(url: str, chain: int, lookups: int) -> dict[str, float]:
    from kvserve.config import TrafficClasses
    from kvstore.index import BlockIndex, IndexRecord

    ix = await BlockIndex(url, node="bench", classes=TrafficClasses(),
                          publish_events=False).start()
    ks = [b"L" + i.to_bytes(4, "little") + b"\0" * 11 for i in range(chain)]
    for i in range(0, chain, 1024):
        await ix.add([IndexRecord(k, 2**20, "chat") for k in ks[i:i + 1024]], tier="G3")
    for _ in range(20):
        await ix.match_chain(ks)
    times = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        m = await ix.match_chain(ks, traffic_class="chat")
        times.append(time.perf_counter() - t0)
        if m.matched != chain:
            raise RuntimeError("lookup lost blocks during the benchmark")
    await ix.delete(ks)
    await ix.close()
    p50, p99 = _percentiles(times)
    return {"lookup_p50_ms": p50, "lookup_p99_ms": p99}


async def bench_service(d: _Data, repeats: int, url: str, chain: int,
                        lookups: int) -> dict[str, float]:
    import numpy as np

    from kvstore.client import KVStoreClient
    from kvstore.redis_server import free_port
    from kvstore.types import RequestCtx

    port = free_port()
    g2 = 2 * d.total * (repeats + 2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--metrics-port", "-1", "--redis-url", url, "--node", "bench-svc",
        "--g2-bytes", str(g2), stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    if not line.startswith("kvstore ready"):
        proc.kill()
        raise RuntimeError(f"store did not start: {line!r}")
    out: dict[str, float] = {}
    ctx = RequestCtx(tenant="bench")
    layout = f"L1xH1xT{d.size // 8}xD1:float32"               # 1*2*1*T*1*4 bytes = size
    dst = np.empty_like(d.arr)
    dst.fill(0)
    try:
        for mode, shm in (("grpc", False), ("shm", True)):
            async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=120, use_shm=shm) as c:
                await c.stats()
                tag = 300 if shm else 200
                warm = d.keys(tag + 99)
                await c.put(warm, d.arr, layout=layout, token_count=1, ctx=ctx)
                await c.get(warm, ctx=ctx, out=dst)
                put_times, get_times = [], []
                for r in range(repeats):
                    ks = d.keys(tag + r)
                    t0 = time.perf_counter()
                    await c.put(ks, d.arr, layout=layout, token_count=1, ctx=ctx)
                    put_times.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = await c.get(ks, ctx=ctx, out=dst)
                    get_times.append(time.perf_counter() - t0)
                    if got.hit_prefix != d.n:
                        raise RuntimeError(f"{mode}: {d.n - got.hit_prefix} blocks missing")
                if not np.array_equal(dst, d.arr):
                    raise RuntimeError(f"{mode}: bytes differ after a round trip")
                out[f"{mode}_put_gbps"] = d.total / min(put_times) / 1e9
                out[f"{mode}_gbps"] = d.total / min(get_times) / 1e9
        async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            ks = [b"G" + i.to_bytes(4, "little") + b"\0" * 11 for i in range(chain)]
            times = []
            for _ in range(min(lookups, 100)):
                t0 = time.perf_counter()
                await c.lookup(ks, prompt_tokens=chain * 64, ctx=ctx)
                times.append(time.perf_counter() - t0)
            out["grpc_lookup_p50_ms"], out["grpc_lookup_p99_ms"] = _percentiles(times)
    finally:
        proc.terminate()
        await proc.wait()
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from kvstore.memtune import tune_malloc
    from kvstore.redis_server import EmbeddedRedis

    tune_malloc()
    d = _Data(args.blocks, args.block_bytes)
    res: dict[str, Any] = {"block_bytes": d.size, "blocks": d.n, "total_bytes": d.total}
    embedded = None
    url = args.redis_url or os.environ.get("REDIS_URL", "")
    if not url:
        embedded = EmbeddedRedis().start()
        url = embedded.url
    steps = ["memory", "disk", "redis", "lookup", "service"]
    try:
        with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp, \
                tqdm(total=len(steps), desc="bench store", file=sys.stderr) as bar:
            for step in steps:
                bar.set_postfix_str(step)
                if step == "memory":
                    res.update(bench_memory(d, args.repeats))
                elif step == "disk":
                    res.update(bench_disk(d, args.repeats, Path(tmp)))
                elif step == "redis":
                    res.update(bench_redis(d, args.repeats, url))
                elif step == "lookup":
                    res.update(asyncio.run(bench_lookup(url, args.chain, args.lookups)))
                else:
                    res.update(asyncio.run(bench_service(d, args.repeats, url, args.chain,
                                                         args.lookups)))
                bar.update()
    finally:
        if embedded is not None:
            embedded.stop()
    res["mooncake"] = "not installed (see docs/BENCHMARKS.md)"
    for got, ref, ratio in GOALS:
        res[f"{got}_over_{ref}"] = res[got] / res[ref]
    return res


def _table(res: dict[str, Any]) -> str:
    rows = [(k, v) for k, v in res.items() if isinstance(v, float)]
    width = max(len(k) for k, _ in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -------"]
    lines += [f"{k:<{width}}  {v:8.3f}" for k, v in rows]
    lines.append(f"(blocks {res['blocks']} x {res['block_bytes']} B; best of repeats)")
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k.removesuffix("_gbps"), v) for k, v in res.items()
            if k.endswith("_gbps") and isinstance(v, float)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([k for k, _ in rows], [v for _, v in rows])
    ax.set_xlabel("GB/s")
    ax.set_title(f"kvserve bench store ({res['blocks']} x {res['block_bytes'] // 2**20} MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    res = measure(args)
    if args.png:
        _plot(res, args.png)
    print(json.dumps(res, indent=None) if args.json else _table(res))
    return 0
