"""The same-GPU hand-off on a real GPU (skipped without one): prefill and two
decodes as their own processes on one device, one decode with the CUDA IPC
hand-off, one without; the test process as a third, pulling on its own.

Token-identical answers through either decode; the KV a device pull adopts is
bit-identical to the file's and the byte stream's; a shared copy that its
puller never opens (the puller killed) is dropped after ``--ipc-hold`` and
the dead puller's reference counted down, so its device memory comes back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decode_svc.pull import KVPuller
from engine.staging import DeviceBudget, PinnedChunks
from kvstore.redis_server import EmbeddedRedis
from proto import prefill_pb2
from service import kv_ipc
from service.config import Endpoint
from service.kv_buffer import KVShape, Upload
from tests.decode_svc.stack import decode, prefill, prompt
from tests.prefill_svc import procs
from tests.tls import channel, security

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HOLD_S = 3.0


class GpuStack:
    def __init__(self, base: Path, redis_url: str) -> None:
        config = procs.write_config(base / "kvserve.toml")
        cuda = ("--device", "cuda", "--gpu-fraction", "0.1")
        self.store = procs.store(config, redis_url, base)
        self.store.start()
        self.pre = procs.engine_service("prefill", config, redis_url, base,
                                        store_address=self.store.address,
                                        extra=(*cuda, "--ipc-hold", str(HOLD_S)))
        self.ipc = procs.engine_service("decode", config, redis_url, base,
                                        store_address=self.store.address, extra=cuda)
        self.shm = procs.engine_service("decode", config, redis_url, base,
                                        store_address=self.store.address,
                                        extra=(*cuda, "--no-ipc-pulls"))
        procs.start_all(self.pre, self.ipc, self.shm)
        self.store.wait_ready()
        self.channels = {p.address: channel(p.address) for p in (self.pre, self.ipc, self.shm)}

    def stub(self, proc: procs.Proc) -> object:
        from proto import decode_pb2_grpc, prefill_pb2_grpc

        ch = self.channels[proc.address]
        return (prefill_pb2_grpc.PrefillStub(ch) if proc is self.pre
                else decode_pb2_grpc.DecodeStub(ch))

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        for p in (self.shm, self.ipc, self.pre, self.store):
            p.stop()


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuStack]:
    with EmbeddedRedis() as redis:
        s = GpuStack(tmp_path_factory.mktemp("gpu-ipc"), redis.url)
        try:
            yield s
        finally:
            s.close()


def _m(proc: procs.Proc, name: str) -> float:
    return proc.metrics().get(name, 0.0)


def _shape() -> KVShape:
    """The KV geometry the services run with (tiny-dense, the engine's CUDA dtype)."""
    from engine import Engine, EngineConfig

    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=procs.BLOCK, num_blocks=8,
                              device="cuda"))
    mc = ref.model_config
    return KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, ref.dtype)


def test_device_and_file_hand_offs_answer_token_identically(gpu_stack: GpuStack) -> None:
    ipc_key = "kvserve_decode_decode_kv_sources_total{kind=ipc}"
    shm_key = "kvserve_decode_decode_kv_sources_total{kind=shm}"
    pulls = "kvserve_prefill_prefill_pulls_total{kind=ipc}"
    before = (_m(gpu_stack.ipc, ipc_key), _m(gpu_stack.shm, shm_key), _m(gpu_stack.pre, pulls))
    pre = gpu_stack.stub(gpu_stack.pre)
    for seed in (81, 82, 83):
        p = prompt(seed, 120 + seed)
        via_ipc = decode(gpu_stack.stub(gpu_stack.ipc), prefill(pre, p, max_tokens=12),
                         max_tokens=12)
        via_shm = decode(gpu_stack.stub(gpu_stack.shm), prefill(pre, p, max_tokens=12),
                         max_tokens=12)
        assert via_ipc.tokens == via_shm.tokens and len(via_ipc.tokens) == 12
    assert _m(gpu_stack.ipc, ipc_key) == before[0] + 3
    assert _m(gpu_stack.shm, shm_key) == before[1] + 3
    assert _m(gpu_stack.pre, pulls) == before[2] + 3
    # Each released: no device copy left behind in prefill's buffer.
    deadline = time.monotonic() + 10
    while _m(gpu_stack.pre, "kvserve_prefill_buffer_device") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _m(gpu_stack.pre, "kvserve_prefill_buffer_device") == 0


def test_the_device_pull_adopts_the_same_bits_as_the_file_and_the_stream(
        gpu_stack: GpuStack) -> None:
    pre = gpu_stack.stub(gpu_stack.pre)
    p = prompt(84, 150)
    a, b = prefill(pre, p, max_tokens=4), prefill(pre, p, max_tokens=4)
    shape = _shape()
    dev = torch.device("cuda", torch.cuda.current_device())

    async def pulls() -> list[tuple[torch.Tensor, str]]:
        up = Upload(dev, PinnedChunks(sets=1, pin=True), DeviceBudget(1 << 30))
        ipc = KVPuller(Endpoint(), timeout_s=30, use_shm=True, shm_dir="/dev/shm",
                       security=security("decode"), upload=up,
                       ipc_device=kv_ipc.device_uuid(dev))
        shm = KVPuller(Endpoint(), timeout_s=30, use_shm=True, shm_dir="/dev/shm",
                       security=security("decode"), upload=up)
        stream = KVPuller(Endpoint(), timeout_s=30, use_shm=False, shm_dir="/dev/shm",
                          security=security("decode"))
        try:
            out = [await ipc.pull(a, shape)]
            out.append(await stream.pull(a, shape))    # the same entry, now via the host
            out.append(await shm.pull(b, shape))       # another prefill of the same prompt
            for h in (a, b):
                await ipc.release(h)
        finally:
            for x in (ipc, shm, stream):
                await x.close()
        return [(r.kv, r.path) for r in out]

    (k_ipc, p_ipc), (k_stream, p_stream), (k_shm, p_shm) = asyncio.run(pulls())
    assert (p_ipc, p_stream, p_shm) == ("ipc", "stream", "shm")
    assert k_ipc.device.type == "cuda" and k_ipc.shape == shape.dims(len(p))
    assert torch.equal(k_ipc.cpu(), k_stream.cpu())
    assert torch.equal(k_ipc.cpu(), k_shm.cpu())


_CHILD = """
import os, sys
from proto import prefill_pb2, prefill_pb2_grpc
from service import kv_ipc
from tests.tls import channel
ch = channel(sys.argv[1])
chunks = list(prefill_pb2_grpc.PrefillStub(ch).PullKV(prefill_pb2.PullKVRequest(
    request_id=sys.argv[2], use_shm=True, ipc_device=sys.argv[3],
    ipc_peer=kv_ipc.peer_id()), timeout=30))
print("ipc" if chunks and chunks[0].HasField("ipc") else "host", flush=True)
os._exit(0)     # dies holding its reference: never maps it, never releases
"""


def test_a_shared_copy_whose_puller_died_is_freed_after_the_hold(gpu_stack: GpuStack) -> None:
    pre = gpu_stack.stub(gpu_stack.pre)
    h = prefill(pre, prompt(85, 200), max_tokens=4)
    uuid = kv_ipc.device_uuid(torch.device("cuda", torch.cuda.current_device()))
    expired = _m(gpu_stack.pre, "kvserve_prefill_buffer_ipc_expired")
    orphans = _m(gpu_stack.pre, "kvserve_prefill_buffer_ipc_orphans")
    out = subprocess.run([sys.executable, "-c", _CHILD, gpu_stack.pre.address,
                          h.ctx.request_id, uuid], capture_output=True, text=True,
                         timeout=120, env=os.environ.copy(), check=True)
    assert out.stdout.strip() == "ipc", out.stderr[-2000:]
    assert _m(gpu_stack.pre, "kvserve_prefill_buffer_device") >= 1
    deadline = time.monotonic() + HOLD_S + 10
    while (_m(gpu_stack.pre, "kvserve_prefill_buffer_ipc_orphans") == orphans
           and time.monotonic() < deadline):
        time.sleep(0.3)
    assert _m(gpu_stack.pre, "kvserve_prefill_buffer_ipc_expired") == expired + 1
    assert _m(gpu_stack.pre, "kvserve_prefill_buffer_ipc_orphans") == orphans + 1
    assert _m(gpu_stack.pre, "kvserve_prefill_buffer_device") == 0
    # The handle is gone: a decode that comes now rebuilds it, still exactly.
    with pytest.raises(Exception, match="no longer buffered"):
        list(pre.PullKV(prefill_pb2.PullKVRequest(request_id=h.ctx.request_id), timeout=10))
