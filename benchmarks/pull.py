"""One prefill -> decode hand-off, alone: ``python -m benchmarks.pull``.

A prefill process serves ``PullKV`` (the service's own handler and
``KVBuffer``) over a real socket for ``--pulls`` resident prompts of
``--tokens`` tokens each (llama-8b-shape KV by default: 2,048 tokens =
268 MB in bf16); its "engine" is a host KV pool whose export is the engine's
own gather (``KVStorage.export_tokens``). A decode process pulls them all at
once with ``KVPuller`` (shared memory, or ``--stream``) and adopts each into
its own pool (``KVStorage.import_tokens``). Each stage is timed where it
runs, summed over the pulls, against one plain memcpy of the same bytes.

    python -m benchmarks.pull [--pulls 8] [--tokens 2048] [--stream] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from engine.kv_pool import KVLayout, KVStorage

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16      # llama-8b-shape


class Stages:
    """Seconds per stage, summed over calls (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.s[name] += time.perf_counter() - t0
                self.n[name] += 1

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            with self.time(name):
                return fn(*a, **kw)

        setattr(obj, attr, timed)

    def table(self) -> dict[str, dict[str, float]]:
        return {k: {"s": round(v, 4), "calls": self.n[k]} for k, v in self.s.items()}


def _layout() -> KVLayout:
    return KVLayout(LAYERS, KV_HEADS, BLOCK, HEAD_DIM, "bfloat16")


def _slots(n: int) -> torch.Tensor:
    return torch.arange(n)


def _prefill(conn: Any, pulls: int, tokens: int, shm_dir: str) -> None:
    """The prefill side, in its own process."""
    import grpc

    from prefill_svc.server import PrefillService, PrefillStats
    from proto import prefill_pb2_grpc
    from service import kv_shm
    from service.kv_buffer import KVBuffer, Resident

    stages = Stages()
    stages.wrap(kv_shm, "piece_checksum", "prefill: checksum")
    stages.wrap(kv_shm, "create_private", "prefill: shm write")
    layout = _layout()
    blocks = -(-tokens // BLOCK) * pulls
    pool = KVStorage(layout, blocks, torch.device("cpu"))
    pool.data.view(torch.int16).random_(-2**14, 2**14)

    async def serve() -> None:
        svc = object.__new__(PrefillService)
        svc.buffer = KVBuffer(max_bytes=2**40, chunk_bytes=4 * 2**20, shm_dir=shm_dir)
        svc.stats = PrefillStats()
        svc.steps = SimpleNamespace(jobs={})
        for i in range(pulls):
            slots = _slots(tokens) + i * -(-tokens // BLOCK) * BLOCK

            async def materialize(first: int, slots: torch.Tensor = slots) -> torch.Tensor:
                def export() -> torch.Tensor:
                    with stages.time("prefill: export (engine gather)"):
                        return pool.export_tokens(slots[first:])
                return await asyncio.to_thread(export)

            svc.buffer.put_resident(f"r{i}", tokens, seed=1000 + i,
                                    resident=Resident(materialize, lambda: None))
        stages.wrap(svc.buffer, "shm_piece", "prefill: shm_piece (lock, checksum, write)")
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 2**30),
                                          ("grpc.max_receive_message_length", 2**30)])
        prefill_pb2_grpc.add_PrefillServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send(stages.table())
        await server.stop(None)
        svc.buffer.close()          # its /dev/shm files: 8 x 268 MB a run otherwise

    asyncio.run(serve())


def _memcpy_s(nbytes: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a).fill_(0)
    t = time.perf_counter()
    b.copy_(a)
    return time.perf_counter() - t


async def _decode(port: int, pulls: int, tokens: int, shm: bool, shm_dir: str,
                  stages: Stages) -> dict[str, Any]:
    from decode_svc.pull import KVPuller
    from proto import common_pb2, prefill_pb2
    from security.config import SecurityConfig
    from service.config import Endpoint
    from service.kv_buffer import KVAssembler, KVShape

    stages.wrap(KVAssembler, "add", "decode: place + verify (KVAssembler.add)")
    sec = SecurityConfig(insecure=True)
    puller = KVPuller(Endpoint(security=sec), timeout_s=600.0, use_shm=shm, shm_dir=shm_dir,
                      security=sec)
    shape = KVShape(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16)
    pool = KVStorage(_layout(), -(-tokens // BLOCK) * pulls, torch.device("cpu"))
    each: list[float] = []

    async def one(i: int) -> int:
        h = prefill_pb2.KVHandle(ctx=common_pb2.RequestContext(request_id=f"r{i}"),
                                 prefill_address=f"127.0.0.1:{port}",
                                 prompt_ids=[1] * tokens, kv_seed=1000 + i)
        t = time.perf_counter()
        pulled = await puller.pull(h, shape)
        each.append(time.perf_counter() - t)
        slots = _slots(tokens) + i * -(-tokens // BLOCK) * BLOCK
        with stages.time("decode: adopt (import_tokens)"):
            pool.import_tokens(slots, pulled.kv)
        return pulled.nbytes

    t0 = time.perf_counter()
    nbytes = sum(await asyncio.gather(*(one(i) for i in range(pulls))))
    wall = time.perf_counter() - t0
    await puller.close()
    return {"wall_s": wall, "bytes": nbytes, "pull_s": sorted(each)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(theirs, args.pulls, args.tokens, args.shm_dir),
                       daemon=True)
    proc.start()
    port = ours.recv()
    stages = Stages()
    res = asyncio.run(_decode(port, args.pulls, args.tokens, not args.stream, args.shm_dir,
                              stages))
    ours.send("done")
    prefill_stages = ours.recv()
    proc.join(10)
    per = res["bytes"] / args.pulls
    memcpy = _memcpy_s(int(per))
    pull_s = res["pull_s"]
    return {
        "path": "stream" if args.stream else "shm", "pulls": args.pulls,
        "tokens": args.tokens, "mb_per_pull": round(per / 1e6, 1),
        "wall_s": round(res["wall_s"], 3),
        "aggregate_gb_s": round(res["bytes"] / res["wall_s"] / 1e9, 3),
        "pull_s_median": round(pull_s[len(pull_s) // 2], 3),
        "pull_s_sum": round(sum(pull_s), 3),
        "per_pull_gb_s": round(res["bytes"] / sum(pull_s) / 1e9, 3),
        "memcpy_one_pull_s": round(memcpy, 4),
        "stages": {**prefill_stages, **stages.table()},
    }


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pulls", type=int, default=8, help="pulls at once (default 8)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens a prompt (default 2048)")
    p.add_argument("--stream", action="store_true", help="the byte stream, not /dev/shm")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args)
    if args.json:
        out(json.dumps(r, indent=1))
        return
    out(f"{r['pulls']} pulls of {r['mb_per_pull']} MB at once ({r['path']}): "
        f"{r['wall_s']} s wall, {r['aggregate_gb_s']} GB/s in all; a pull: median "
        f"{r['pull_s_median']} s, {r['per_pull_gb_s']} GB/s (one memcpy of it "
        f"{r['memcpy_one_pull_s'] * 1e3:.0f} ms)")
    for k, v in sorted(r["stages"].items()):
        out(f"  {k:50s} {v['s']:8.3f} s over {v['calls']} calls")


if __name__ == "__main__":
    main()
