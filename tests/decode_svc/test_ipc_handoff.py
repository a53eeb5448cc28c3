"""The same-GPU hand-off's negotiation and its check, on CPU: a decode that
names a GPU prefill does not run on gets the shared-memory file (real
processes, real gRPC); a decode without CUDA never asks; the device digest
tells any changed byte from the copy prefill took it over."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.config import ConfigError
from decode_svc.config import DecodeConfig
from decode_svc.pull import KVPuller
from engine.staging import DeviceBudget, PinnedChunks
from prefill_svc.config import PrefillConfig
from proto import prefill_pb2
from service import kv_ipc
from service.config import Endpoint
from service.kv_buffer import KVShape, Upload
from tests.decode_svc.stack import Stack, decode, prefill, prompt, reference
from tests.prefill_svc import procs
from tests.tls import security

# A well-formed UUID no device here has.
OTHER_GPU = "00000000-1111-2222-3333-444444444444"


def _metric(proc: procs.Proc, name: str) -> float:
    return proc.metrics().get(name, 0.0)


def _pulls(stack: Stack) -> dict[str, float]:
    m = stack.prefill.metrics()
    return {k: m.get(f"kvserve_prefill_prefill_pulls_total{{kind={k}}}", 0.0)
            for k in ("ipc", "shm", "stream")} | {
        "declined": m.get("kvserve_prefill_prefill_pulls_ipc_declined_total", 0.0)}


def test_a_decode_naming_another_gpu_is_served_the_shared_memory_file(stack: Stack) -> None:
    """The prefill engine runs on CPU: a pull that offers a device hand-off
    (real gRPC, decode's credentials) is answered with the /dev/shm file,
    counted as declined, and its KV is the very bytes a byte stream of the
    same entry carries."""
    shape = KVShape(stack.ref.model_config.num_layers, stack.ref.model_config.num_kv_heads,
                    stack.ref.model_config.head_dim, stack.ref.dtype)
    p = prompt(71, 40)
    handle = prefill(stack.prefill_stub(), p, max_tokens=4)
    before = _pulls(stack)

    async def pulls() -> tuple[torch.Tensor, str, torch.Tensor, str]:
        upload = Upload(torch.device("cpu"), PinnedChunks(sets=1, pin=False),
                        DeviceBudget(1 << 30))
        offered = KVPuller(Endpoint(), timeout_s=20, use_shm=True, shm_dir="/dev/shm",
                           security=security("decode"), upload=upload, ipc_device=OTHER_GPU)
        streamed = KVPuller(Endpoint(), timeout_s=20, use_shm=False, shm_dir="/dev/shm",
                            security=security("decode"))
        try:
            a = await offered.pull(handle, shape)
            b = await streamed.pull(handle, shape)
            await offered.release(handle)
        finally:
            await offered.close()
            await streamed.close()
        return a.kv, a.path, b.kv, b.path

    kv, path, streamed_kv, streamed_path = asyncio.run(pulls())
    assert (path, streamed_path) == ("shm", "stream")
    assert kv.shape == shape.dims(len(p)) and torch.equal(kv.cpu(), streamed_kv)
    after = _pulls(stack)
    assert after["declined"] == before["declined"] + 1
    assert after["shm"] == before["shm"] + 1 and after["ipc"] == before["ipc"]


def test_a_raw_pull_naming_a_gpu_gets_no_handle_from_a_cpu_prefill(stack: Stack) -> None:
    """What goes over the wire: no CudaIpc message, a file, its checksum."""
    handle = prefill(stack.prefill_stub(), prompt(72, 33), max_tokens=4)
    chunks = list(stack.prefill_stub().PullKV(
        prefill_pb2.PullKVRequest(request_id=handle.ctx.request_id, use_shm=True,
                                  ipc_device=OTHER_GPU, ipc_peer=kv_ipc.peer_id()),
        timeout=20))
    stack.prefill_stub().Release(prefill_pb2.ReleaseRequest(request_id=handle.ctx.request_id),
                                 timeout=20)
    assert len(chunks) == 1 and not chunks[0].HasField("ipc")
    assert chunks[0].shm_name and len(chunks[0].checksum) == 16


def test_a_cpu_decode_never_asks_and_decodes_exactly_from_the_file(stack: Stack) -> None:
    p = prompt(73, 50)
    before = _pulls(stack)
    srcs = "kvserve_decode_decode_kv_sources_total{kind=shm}"
    shm_before = _metric(stack.decode, srcs)
    out = decode(stack.decode_stub(), prefill(stack.prefill_stub(), p, max_tokens=6),
                 max_tokens=6)
    assert out.tokens == reference(stack.ref, p, 6)
    after = _pulls(stack)
    assert after["declined"] == before["declined"] and after["ipc"] == before["ipc"]
    assert _metric(stack.decode, srcs) == shm_before + 1


def test_the_device_digest_changes_with_any_byte_and_with_the_seed() -> None:
    g = torch.Generator().manual_seed(3)
    kv = torch.randn((2, 2, 2, 37, 64), generator=g).to(torch.bfloat16)  # not a whole row
    d = kv_ipc.device_digest(kv, 11)
    assert len(d) == 16 and d == kv_ipc.device_digest(kv.clone(), 11)
    assert d != kv_ipc.device_digest(kv, 12)
    raw_len = kv.numel() * kv.element_size()
    for at in (0, 1, raw_len // 2, raw_len - 1):
        for bit in (0x01, 0x80):
            changed = kv.clone()
            changed.view(-1).view(torch.uint8)[at] ^= bit
            assert kv_ipc.device_digest(changed, 11) != d, (at, bit)
    # Two words' top bits at once: a linear hash over 64-bit words with odd
    # weights would cancel this; over 32-bit words with 64-bit weights it cannot.
    two = kv.clone()
    words = two.view(-1).view(torch.int32)
    words[0] ^= -(1 << 31)
    words[1] ^= -(1 << 31)
    assert kv_ipc.device_digest(two, 11) != d


def test_peer_ids_name_live_processes_only() -> None:
    me = kv_ipc.peer_id()
    assert not kv_ipc.peer_gone(me)
    ns = me.split("-", 1)[0]
    assert kv_ipc.peer_gone(f"{ns}-{2**22 + 12345}")     # above any pid_max: no such process
    assert not kv_ipc.peer_gone("1-1")                     # another namespace: unknown
    assert not kv_ipc.peer_gone("garbage")


def test_ipc_knobs_are_validated_and_default_on() -> None:
    assert PrefillConfig().ipc_pulls and DecodeConfig().use_ipc
    assert not PrefillConfig(ipc_pulls=False).ipc_pulls
    with pytest.raises(ConfigError, match="ipc_hold_s"):
        PrefillConfig(ipc_hold_s=0)
    assert kv_ipc.device_uuid(torch.device("cpu")) == ""
