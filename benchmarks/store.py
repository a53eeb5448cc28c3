"""``kvserve bench store``: the warehouse's data paths against raw baselines,
side by side in one run (same blocks, same machine, same moment).

Rows (GB/s unless noted; best of ``--repeats``, the same rule for every row; a
row and its baseline run in turn within each round, so both see the same
moments of a shared machine):
- memcpy: numpy copy of the blocks into a reused buffer (the ceiling of any
  in-memory path); g2_put / g2_get: the G2 tier (copy + xxh3 checksum);
  verified_copy: one thread copying every slot out of the G2 segment with the
  hash-while-copying check a same-host reader runs (``copy_verified``);
- raw_write / raw_read: the same bytes as ONE plain file written in
  sequence with one fsync, read back block by block with ``f.read``;
  g3_write / g3_read: the G3 tier as the warehouse drives it (one file per
  block, atomic: temp file, fsync, rename, directory fsync, group-committed
  through ``put_many``; read + verify, keyed header MAC). Reads come from the
  page cache, as the files were just written. g3_xxh3tag_*: the same with the
  header tag before keyed integrity (kvstore/bench_mac.py), in the same rounds;
  mac_*_ratio = the MAC's cost; mac_tag_us / xxh3_tag_us: one header tag;
- redis_put / redis_get: the blocks as Redis values, one SET/GET each (what
  LMCache's Redis backend does);
- lookup p50/p99 ms: one chain lookup of ``--chain`` blocks (loopback Redis,
  TTL refresh on), and grpc_lookup through the service;
- grpc_put / grpc_get: a ``kvserve store serve`` process over loopback TCP
  with mTLS (as deployed); shm_put / shm_get: the same process through shared
  memory. grpc_gbps and shm_gbps are the get figures (restoring KV is the path
  that waits). plain_put / plain_get: a second store in plain text
  (``--insecure``), so tls_put_ratio / tls_get_ratio = the cost of TLS.
  shm_get_vs_memcpy: shm get (every copy verified against its checksum) over
  the memcpy of the same bytes in the same rounds;
- ack_g2_put / ack_durable_put: puts acknowledged at G2 vs after the G3 fsync
  (benchmarks/store_ack.py), ack_durable_vs_g2 their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import Chart, Goal, Report, Table, Timing, check_goals, interleaved
from security.flags import redis_url_from

# Mooncake Store over TCP on loopback, measured on these CPU machines
# (docs/architecture.md#reference-figures):
# put 1.0-1.5 GB/s, get 1.1-1.8 GB/s, 2,048-key existence check 2.65 ms p99.
MOONCAKE = {"put_gbps": (1.0, 1.5), "get_gbps": (1.1, 1.8), "lookup_p99_ms": 2.65}
GOALS: tuple[Goal, ...] = (
    Goal("G3 write >= 0.9x raw write", "g3_write_gbps", at_least=0.9, ref="raw_write_gbps"),
    Goal("G3 read >= 0.9x raw read", "g3_read_gbps", at_least=0.9, ref="raw_read_gbps"),
    Goal("shm get >= 0.9x memcpy (interleaved)", "shm_gbps", at_least=0.9, ref="shm_memcpy_gbps"),
    Goal("lookup p99 < 2 ms", "lookup_p99_ms", below=2.0),
    Goal("gRPC put >= 1.5x Mooncake (1.5 GB/s high end)", "grpc_put_gbps", at_least=1.5 * 1.5),
    Goal("gRPC get >= 1.5x Mooncake (1.8 GB/s high end)", "grpc_gbps", at_least=1.5 * 1.8),
    # Mooncake measured in the same run, when --mooncake-python gives it:
    Goal("gRPC put >= 1.5x Mooncake put (same run)", "grpc_put_gbps", at_least=1.5,
         ref="mooncake_put_gbps"),
    Goal("gRPC get >= 1.5x Mooncake get (same run)", "grpc_gbps", at_least=1.5,
         ref="mooncake_get_gbps"),
    Goal("lookup p99 < Mooncake's (same run)", "lookup_p99_ms", below=1.0,
         ref="mooncake_lookup_p99_ms"),
)


def _interleaved(nbytes: int, repeats: int,
                 fns: dict[str, Callable[[int], None]]) -> dict[str, float]:
    """Best GB/s of each function, the functions run in turn within every round."""
    return {name: nbytes / tm.min / 1e9
            for name, tm in interleaved(fns, rounds=repeats).items()}


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

    g2 = HostTier("mem://bench", name="G2", capacity_bytes=d.total + 2**20, pin=False)
    try:
        g2.prefault()

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

        from kvstore.tiers.shm import attach_segment, copy_verified

        seg = attach_segment(g2.shm_name)

        def verified_copy(_: int) -> None:
            # What a same-host reader does per slot: copy out + xxh3 of the copy.
            for i, k in enumerate(last):
                slot = g2.locate(k)
                if slot is None or not copy_verified(seg, slot, memoryview(dst[i])):
                    raise RuntimeError("a G2 slot failed verification during the benchmark")

        out = _interleaved(d.total, repeats, {"memcpy_gbps": memcpy, "g2_put_gbps": put,
                                              "g2_get_gbps": get,
                                              "verified_copy_gbps": verified_copy})
        out["verified_copy_vs_memcpy"] = out["verified_copy_gbps"] / out["memcpy_gbps"]
        seg.close()
    finally:
        g2.close()
    return out


def bench_disk(d: _Data, repeats: int, root: Path) -> dict[str, float]:
    from kvstore.bench_mac import Xxh3Tag, mac_rows
    from kvstore.blockfile import BlockMac, BlockMeta
    from kvstore.tiers import open_tier

    raw_dir = root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)

    def raw_write(r: int) -> None:
        # One plain file, the blocks written in sequence, one fsync: the disk's ceiling.
        fd = os.open(raw_dir / f"seq-{r}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for v in d.views:
                os.write(fd, v)
            os.fsync(fd)
        finally:
            os.close(fd)

    def raw_read(_: int) -> None:
        with open(raw_dir / "seq-0", "rb", buffering=0) as f:
            for _ in range(d.n):
                if len(f.read(d.size)) != d.size:
                    raise RuntimeError("short read")

    g3 = open_tier(str(root / "g3"), name="G3", capacity_bytes=100 * d.total,
                   mac=BlockMac(os.urandom(32)))
    v1 = open_tier(str(root / "g3-v1"), name="G3", capacity_bytes=100 * d.total, mac=Xxh3Tag())

    def writer(tier: Any, tag: int) -> tuple[Callable[[int], None], Callable[[int], None]]:
        keys: list[list[bytes]] = []

        def write(r: int) -> None:
            ks = d.keys(tag + r)
            keys.append(ks)
            tier.put_many([(k, v, BlockMeta(k, "", "", 1, "chat", time.time() + 3600))
                           for k, v in zip(ks, d.views, strict=True)])  # the warehouse's path

        def read(_: int) -> None:
            for k in keys[0]:
                if tier.get(k) is None:
                    raise RuntimeError("G3 lost a block during the benchmark")

        return write, read

    (g3_write, g3_read), (v1_write, v1_read) = writer(g3, 100), writer(v1, 200)
    out = _interleaved(d.total, repeats, {"raw_write_gbps": raw_write,
                                          "g3_write_gbps": g3_write,
                                          "g3_xxh3tag_write_gbps": v1_write})
    out.update(_interleaved(d.total, repeats, {"raw_read_gbps": raw_read,
                                               "g3_read_gbps": g3_read,
                                               "g3_xxh3tag_read_gbps": v1_read}))
    for t in (g3, v1):
        t.close()
    return {**out, **mac_rows(out)}


def bench_redis(d: _Data, repeats: int, url: str) -> dict[str, float]:
    from kvstore.redis_conn import connect_sync

    r = connect_sync(url)       # one server or a redis+cluster:// URL
    ks = d.keys(7)

    def put(_: int) -> None:
        for k, v in zip(ks, d.views, strict=True):
            r.set(b"bench:" + k, v)

    def get(_: int) -> None:
        for k in ks:
            if r.get(b"bench:" + k) is None:
                raise RuntimeError("Redis lost a value")

    out = _interleaved(d.total, repeats, {"redis_put_gbps": put, "redis_get_gbps": get})
    r.delete(*[b"bench:" + k for k in ks])
    r.close()
    return out


def _percentiles(times: list[float]) -> tuple[float, float]:
    """p50 and p99, ms."""
    tm = Timing(tuple(times))
    return tm.median * 1e3, tm.quantile(0.99) * 1e3


async def bench_lookup(url: str, chain: int, lookups: int) -> dict[str, float]:
    from common.config import TrafficClasses
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

    from common.config import TrafficClasses
    from kvstore.client import KVStoreClient
    from kvstore.index import BlockIndex, IndexRecord
    from kvstore.redis_server import free_port
    from kvstore.types import RequestCtx
    from security.config import TLS_DIR_ENV, SecurityConfig
    from security.pki import ensure_deployment
    from security.secret_files import redis_url_args

    # The service as deployed (mTLS), and beside it the same store in plain text
    # (--insecure) so the cost of TLS on the gRPC path is measured in the same run.
    tls_tmp = tempfile.TemporaryDirectory(prefix="kvserve-bench-tls-")
    tls = os.environ.get(TLS_DIR_ENV) or str(ensure_deployment(tls_tmp.name))
    port, plain_port = free_port(), free_port()
    g2 = 2 * d.total * (repeats + 2)
    procs = []
    for p, sec, node in ((port, ["--tls-dir", tls], "bench-svc"),
                         (plain_port, ["--insecure"], "bench-plain")):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
            "--port", str(p), "--metrics-port", "-1", *redis_url_args(url, tls_tmp.name),
            "--node", node,
            "--g2-bytes", str(g2), *sec, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
        procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        if not line.startswith("kvstore ready"):
            for q in procs:
                q.kill()
            raise RuntimeError(f"store did not start: {line!r}")
    secure = SecurityConfig(tls, role="operator")
    plain = SecurityConfig(insecure=True)
    out: dict[str, float] = {}
    ctx = RequestCtx(tenant="bench")
    layout = f"L1xH1xT{d.size // 8}xD1:float32"               # 1*2*1*T*1*4 bytes = size
    dst = np.empty_like(d.arr)
    dst.fill(0)
    try:
        # TLS and plain text take turns inside every round (same moments of a shared
        # machine), so tls_*_ratio compares like with like; shm runs on its own.
        tls_vs_plain = (("grpc", False, port, secure, 200),
                        ("plain", False, plain_port, plain, 400))
        for group in (tls_vs_plain, (("shm", True, port, secure, 300),)):
            clients = [KVStoreClient(f"127.0.0.1:{at}", timeout_s=120, use_shm=shm, security=sec)
                       for _, shm, at, sec, _ in group]
            try:
                runs: dict[str, list[list[float]]] = {m[0]: [[], [], []] for m in group}
                for c, (_, _, _, _, tag) in zip(clients, group, strict=True):
                    await c.stats()
                    warm = d.keys(tag + 99)
                    await c.put(warm, d.arr, layout=layout, token_count=1, ctx=ctx)
                    await c.get(warm, ctx=ctx, out=dst)
                for r in range(repeats):
                    for c, (mode, _, _, _, tag) in zip(clients, group, strict=True):
                        put_t, get_t, copy_t = runs[mode]
                        ks = d.keys(tag + r)
                        t0 = time.perf_counter()
                        await c.put(ks, d.arr, layout=layout, token_count=1, ctx=ctx)
                        put_t.append(time.perf_counter() - t0)
                        dst.fill(0)
                        t0 = time.perf_counter()
                        got = await c.get(ks, ctx=ctx, out=dst)
                        get_t.append(time.perf_counter() - t0)
                        if got.hit_prefix != d.n:
                            raise RuntimeError(f"{mode}: {d.n - got.hit_prefix} blocks missing")
                        if not np.array_equal(dst, d.arr):
                            raise RuntimeError(f"{mode}: bytes differ after a round trip")
                        t0 = time.perf_counter()             # the same bytes, same moment
                        for i in range(d.n):
                            np.copyto(dst[i], d.arr[i])
                        copy_t.append(time.perf_counter() - t0)
                for mode, (put_t, get_t, copy_t) in runs.items():
                    out[f"{mode}_memcpy_gbps"] = d.total / Timing(tuple(copy_t)).min / 1e9
                    out[f"{mode}_put_gbps"] = d.total / Timing(tuple(put_t)).min / 1e9
                    out[f"{mode}_gbps"] = d.total / Timing(tuple(get_t)).min / 1e9
            finally:
                for c in clients:
                    await c.close()
        ks = [b"G" + i.to_bytes(4, "little") + b"\0" * 11 for i in range(chain)]
        ix = await BlockIndex(url, node="bench-svc", classes=TrafficClasses(),
                              publish_events=False).start()
        for i in range(0, chain, 1024):         # entries as the store's own G3 blocks
            await ix.add([IndexRecord(k, 2**20, "chat", tenant=ctx.tenant)
                          for k in ks[i:i + 1024]], tier="G3")
        async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=30, security=secure) as c:
            if (await c.lookup(ks, prompt_tokens=chain * 64, ctx=ctx)).matched_blocks != chain:
                raise RuntimeError("the store does not see the benchmark's index entries")
            times = []
            for _ in range(min(lookups, 100)):
                t0 = time.perf_counter()
                await c.lookup(ks, prompt_tokens=chain * 64, ctx=ctx)
                times.append(time.perf_counter() - t0)
            out["grpc_lookup_p50_ms"], out["grpc_lookup_p99_ms"] = _percentiles(times)
        await ix.delete(ks)
        await ix.close()
        out["tls_put_ratio"] = out["grpc_put_gbps"] / out["plain_put_gbps"]
        out["tls_get_ratio"] = out["grpc_gbps"] / out["plain_gbps"]
    finally:
        for proc in procs:
            proc.terminate()
            await proc.wait()
        tls_tmp.cleanup()
    return out


_MOONCAKE_CLIENT = r"""
import json, os, sys, time
from mooncake.store import MooncakeDistributedStore
role, me, meta, master, n, size, repeats, hold = sys.argv[1:9]
n, size, repeats = int(n), int(size), int(repeats)
s = MooncakeDistributedStore()
seg = (2 * n * size * (repeats + 1)) if role == "holder" else 0
if s.setup(me, meta, seg, 64 << 20, "tcp", "", master) != 0:
    sys.exit("mooncake setup failed")
if role == "holder":
    print("ready", flush=True)
    time.sleep(float(hold))
    sys.exit(0)
data = [os.urandom(size) for _ in range(n)]
put = get = 0.0
for r in range(repeats):
    ks = [f"b{r}-{i}" for i in range(n)]
    t = time.perf_counter()
    for k, d in zip(ks, data):
        if s.put(k, d) != 0:
            sys.exit("mooncake put failed")
    put = max(put, n * size / (time.perf_counter() - t) / 1e9)
    t = time.perf_counter()
    for k in ks:
        if len(s.get(k)) != size:
            sys.exit("mooncake get failed")
    get = max(get, n * size / (time.perf_counter() - t) / 1e9)
keys = [f"b0-{i % n}" for i in range(2048)]
lat = []
for _ in range(200):
    t = time.perf_counter()
    s.batch_is_exist(keys)
    lat.append(time.perf_counter() - t)
lat.sort()
print(json.dumps({"mooncake_put_gbps": put, "mooncake_get_gbps": get,
                  "mooncake_lookup_p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3}))
"""


def bench_mooncake(python: str, d: _Data, repeats: int) -> dict[str, float]:
    """Mooncake Store (CPU build) over TCP on loopback with the same blocks: a
    master, one process holding the memory segment, one client process."""
    import subprocess

    from kvstore.redis_server import free_port

    master_bin = Path(python).parent / "mooncake_master"
    rpc, http, holder_port, client_port = (free_port() for _ in range(4))
    meta = f"http://127.0.0.1:{http}/metadata"
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(subprocess.Popen(
            [str(master_bin), f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
             f"-http_metadata_server_port={http}", "-http_metadata_server_host=127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, text=True))
        time.sleep(1.0)
        common = [meta, f"127.0.0.1:{rpc}", str(d.n), str(d.size), str(repeats)]
        holder = subprocess.Popen(
            [python, "-c", _MOONCAKE_CLIENT, "holder", f"127.0.0.1:{holder_port}", *common,
             "600"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        procs.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError("mooncake holder did not start")
        out = subprocess.run(
            [python, "-c", _MOONCAKE_CLIENT, "client", f"127.0.0.1:{client_port}", *common,
             "0"], capture_output=True, env=env, text=True, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait()


def _mooncake_python(arg: str) -> str:
    """The interpreter that has Mooncake: --mooncake-python, or this one if it has it."""
    if arg:
        return arg
    import importlib.util

    return sys.executable if importlib.util.find_spec("mooncake") else ""


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from kvstore.memtune import tune_malloc
    from kvstore.redis_server import EmbeddedRedis

    tune_malloc()
    d = _Data(args.blocks, args.block_bytes)
    res: dict[str, Any] = {"block_bytes": d.size, "blocks": d.n, "total_bytes": d.total}
    embedded = None
    url = redis_url_from(args)          # never a password on the command line
    if not url:
        embedded = EmbeddedRedis().start()
        url = embedded.url
    mooncake = _mooncake_python(args.mooncake_python)
    steps = ["memory", "disk", "redis", "lookup", "service", "ack", "lanes"] + (
        ["mooncake"] if mooncake else [])
    steps += (["cluster"] if args.redis_cluster else []) + (["g4"] if args.g4 else [])
    if args.only:
        steps = [s for s in steps if s in set(args.only.split(","))]
    try:
        with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp, \
                tqdm(total=len(steps), desc="bench store", file=sys.stderr) as bar:
            run = _steps(args, d, url, Path(tmp), mooncake)
            for step in steps:
                bar.set_postfix_str(step)
                res.update(run[step]())
                bar.update()
    finally:
        if embedded is not None:
            embedded.stop()
    if not mooncake:
        res["mooncake"] = "not installed: pass --mooncake-python (see docs/BENCHMARKS.md)"
    if "shm_gbps" in res:   # every shm copy verified (xxh3 while copying), same run
        res["shm_get_vs_memcpy"] = res["shm_gbps"] / res["shm_memcpy_gbps"]
    res["goals"] = {v.goal: v.as_json() for v in check_goals(_goals(), res)}
    return res


def _goals() -> tuple[Goal, ...]:
    from benchmarks.store_cluster import CLUSTER_GOALS

    return GOALS + CLUSTER_GOALS


def _steps(args: argparse.Namespace, d: _Data, url: str, tmp: Path,
           mooncake: str) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each step of ``--only`` and what it measures."""
    from benchmarks.store_ack import bench_ack
    from benchmarks.store_cluster import bench_cluster, bench_g4
    from benchmarks.store_lanes import bench_lanes

    return {
        "memory": lambda: bench_memory(d, args.repeats),
        "disk": lambda: bench_disk(d, args.repeats, tmp),
        "redis": lambda: bench_redis(d, args.repeats, url),
        "lookup": lambda: asyncio.run(bench_lookup(url, args.chain, args.lookups)),
        "service": lambda: asyncio.run(bench_service(d, args.repeats, url, args.chain,
                                                     args.lookups)),
        # issue 10: puts acknowledged at G2 vs after the G3 fsync
        "ack": lambda: asyncio.run(bench_ack(d.arr, args.repeats, url, tmp)),
        # one process's Puts at once: one staging segment against four lanes
        "lanes": lambda: asyncio.run(bench_lanes(d.arr, args.repeats, url, tmp)),
        "mooncake": lambda: bench_mooncake(mooncake, d, args.repeats),
        "cluster": lambda: bench_cluster(args.redis_cluster, url, args.chain, args.lookups),
        "g4": lambda: bench_g4(args.g4, d.views, args.repeats),
    }


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench store``: the flags in, the harness's report out."""
    res = measure(args)
    rows = [(k, v) for k, v in res.items() if isinstance(v, float)]
    table = Table(("metric", "value"), rows)
    verdicts = check_goals(_goals(), res)
    gbps = [(k.removesuffix("_gbps"), v) for k, v in rows if k.endswith("_gbps")]
    return Report(f"kvserve bench store: blocks {res['blocks']} x {res['block_bytes']} B, "
                  "best of repeats", res, [table], verdicts,
                  chart=Chart(f"kvserve bench store ({res['blocks']} x "
                              f"{res['block_bytes'] // 2**20} MiB)", tuple(k for k, _ in gbps),
                              {"GB/s": [v for _, v in gbps]}, kind="barh", xlabel="GB/s"))
