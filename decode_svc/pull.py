"""Pulling a prefilled request's KV from the prefill instance's host buffer.

Same host (the prefill address resolves to this machine): ask for shared
memory and copy the tensor out of one private /dev/shm file; if that file is
not usable here after all (another container, another user), pull again as a
byte stream. On CUDA the request also names this engine's device (its UUID):
prefill on the same GPU answers with a CUDA IPC handle of a device copy
(service/kv_ipc.py), copied device to device here; a handle that cannot be
mapped is given back and the pull asked again for the host path. Every piece
is verified against the checksum prefill sent for it
(service.kv_buffer.KVAssembler) before anything is adopted. Every call carries
a deadline (the pull's own bound, cut to what is left of the request's);
Release is best effort (prefill drops KV nobody pulls, and decode can rebuild).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from dataclasses import dataclass

import grpc
import torch

from proto import prefill_pb2, prefill_pb2_grpc
from security.config import SecurityConfig
from service import kv_ipc
from service.config import Endpoint
from service.hosting import channel_options
from service.kv_buffer import IpcUnusable, KVAssembler, KVPiece, KVShape, Upload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pulled:
    kv: torch.Tensor                # [layers, 2, kv_heads, L - first, head_dim]
    path: str                       # "ipc" | "shm" | "stream"
    seconds: float
    nbytes: int
    place_seconds: float = 0.0      # of ``seconds``: reading, verifying and placing the KV


@functools.lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, our hostname or one of our addresses)."""
    host = host.strip("[]")
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()):
        return True
    try:
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
        ours = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return bool(theirs & (ours | {"127.0.0.1", "::1"}))


def _share(m: prefill_pb2.CudaIpc) -> kv_ipc.Share:
    return kv_ipc.Share(m.handle, m.storage_bytes, m.offset_bytes, m.ref_handle,
                        m.ref_offset, m.event_handle, m.event_sync)


def _host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


class KVPuller:
    def __init__(self, endpoint: Endpoint, *, timeout_s: float, use_shm: bool,
                 shm_dir: str, security: SecurityConfig | None = None,
                 upload: Upload | None = None, ipc_device: str = "") -> None:
        """``upload``: a same-host pull's file goes straight to the engine's
        device (service.kv_buffer.Upload), not through a host tensor.
        ``ipc_device``: the UUID of that device (kv_ipc.device_uuid) to offer
        same-device hand-offs for; "" never asks for one."""
        self._endpoint = endpoint
        self._ipc_device = ipc_device if upload is not None else ""
        self._upload = upload
        self._security = security or endpoint.security_for("decode")
        self._timeout_s = timeout_s
        self._use_shm = use_shm
        self._shm_dir = shm_dir
        self._stubs: dict[str, tuple[grpc.aio.Channel, prefill_pb2_grpc.PrefillStub]] = {}

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._stubs:
            ch = self._security.aio_channel(address, "prefill",
                                            options=channel_options(self._endpoint))
            self._stubs[address] = (ch, prefill_pb2_grpc.PrefillStub(ch))
        return self._stubs[address][1]

    async def pull(self, handle: prefill_pb2.KVHandle, shape: KVShape, *,
                   budget_s: float | None = None, first: int = 0) -> Pulled:
        """The handle's KV from prompt token ``first`` on, verified. ``budget_s``:
        what is left of the request's deadline (None: no deadline), which bounds
        the pull below its own."""
        t0 = time.perf_counter()
        n = len(handle.prompt_ids)
        timeout = self._timeout_s if budget_s is None else max(0.001, min(self._timeout_s,
                                                                         budget_s))
        local = is_local_host(_host_of(handle.prefill_address))
        # Each way in turn, while the one before says it cannot serve this host.
        ways = [(True, True)] if local and self._use_shm and self._ipc_device else []
        ways += [(True, False)] if local and self._use_shm else []
        ways += [(False, False)]
        place = [0.0]
        asm: KVAssembler | None = None
        for shm, ipc in ways:
            asm = await self._pull_once(handle, shape, n, first, shm, ipc,
                                        timeout - (time.perf_counter() - t0), place)
            if asm is not None:
                break
        assert asm is not None
        kv = asm.done()
        return Pulled(kv, asm.path, time.perf_counter() - t0,
                      kv.numel() * kv.element_size(), place[0])

    async def _pull_once(self, handle: prefill_pb2.KVHandle, shape: KVShape, n: int,
                         first: int, shm: bool, ipc: bool, timeout_s: float,
                         place: list[float]) -> KVAssembler | None:
        asm = KVAssembler(shape, n, seed=handle.kv_seed, shm_dir=self._shm_dir, first=first,
                          upload=self._upload if shm else None)
        call = self._stub(handle.prefill_address).PullKV(
            prefill_pb2.PullKVRequest(request_id=handle.ctx.request_id, use_shm=shm,
                                      start_token=first,
                                      ipc_device=self._ipc_device if ipc else "",
                                      ipc_peer=kv_ipc.peer_id() if ipc else ""),
            timeout=max(0.001, timeout_s))
        async for chunk in call:
            if chunk.shm_name and not asm.shm_usable(chunk.shm_name):
                call.cancel()
                return None
            share = _share(chunk.ipc) if chunk.HasField("ipc") else None
            piece = KVPiece(chunk.start_token, chunk.token_count, chunk.data, chunk.shm_name,
                            chunk.shm_offset, chunk.size, chunk.checksum, ipc=share)
            t = time.perf_counter()
            if piece.shm_name or share is not None:     # file read / device copy: off the loop
                try:
                    await asyncio.to_thread(asm.add, piece)
                except IpcUnusable as exc:
                    log.warning("same-device KV of %s not usable here (%s); host path",
                                handle.ctx.request_id, exc)
                    call.cancel()
                    return None
            else:
                asm.add(piece)
            place[0] += time.perf_counter() - t
        return asm

    async def release(self, handle: prefill_pb2.KVHandle) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await self._stub(handle.prefill_address).Release(
                prefill_pb2.ReleaseRequest(request_id=handle.ctx.request_id),
                timeout=min(2.0, self._timeout_s))

    async def close(self) -> None:
        for ch, _ in self._stubs.values():
            await ch.close(grace=None)
        self._stubs.clear()
