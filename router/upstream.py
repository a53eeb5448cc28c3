"""gRPC calls from the router to prefill and decode instances.

One ``grpc.aio`` channel per instance address, opened on first use and closed
when the instance leaves the live view. Every call carries a deadline. Errors
surface as ``grpc.aio.AioRpcError``; ``router.errors.upstream_error`` decides
what they mean for the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc

from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from security.config import SecurityConfig

_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
    # Find a dead peer fast: the router must stop waiting on a killed instance.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.enable_retries", 0),
)


@dataclass(frozen=True, slots=True)
class CallTimeouts:
    prefill_s: float = 120.0
    decode_first_s: float = 120.0    # from the Decode call to its first event
    decode_total_s: float = 3600.0
    release_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("prefill_s", "decode_first_s", "decode_total_s", "release_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CallTimeouts.{name} must be > 0")


@dataclass(slots=True)
class _Conn:
    channel: grpc.aio.Channel
    prefill: prefill_pb2_grpc.PrefillStub
    decode: decode_pb2_grpc.DecodeStub


@dataclass(slots=True)
class Upstreams:
    timeouts: CallTimeouts = field(default_factory=CallTimeouts)
    security: SecurityConfig | None = None      # None: from the environment (router identity)
    _conns: dict[str, _Conn] = field(default_factory=dict)

    def _conn(self, address: str, role: str) -> _Conn:
        conn = self._conns.get(address)
        if conn is None:
            if self.security is None:
                self.security = SecurityConfig.from_env("router")
            # An address is one instance of one role: its certificate must name it.
            channel = self.security.aio_channel(address, role, options=_CHANNEL_OPTIONS)
            conn = _Conn(channel, prefill_pb2_grpc.PrefillStub(channel),
                         decode_pb2_grpc.DecodeStub(channel))
            self._conns[address] = conn
        return conn

    async def prefill(self, address: str, req: prefill_pb2.PrefillRequest) -> prefill_pb2.KVHandle:
        return await self._conn(address, "prefill").prefill.Prefill(
            req, timeout=self.timeouts.prefill_s)

    async def release(self, handle: prefill_pb2.KVHandle) -> None:
        """Best effort: the prefill instance frees the handle at expiry anyway."""
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await self._conn(handle.prefill_address, "prefill").prefill.Release(
                prefill_pb2.ReleaseRequest(request_id=handle.ctx.request_id),
                timeout=self.timeouts.release_s)

    def decode(self, address: str, handle: prefill_pb2.KVHandle,
               sampling: common_pb2.SamplingParams) -> DecodeCall:
        call = self._conn(address, "decode").decode.Decode(
            decode_pb2.DecodeRequest(handle=handle, sampling=sampling),
            timeout=self.timeouts.decode_total_s)
        return DecodeCall(call, self.timeouts.decode_first_s)

    async def retain(self, addresses: Iterable[str]) -> None:
        """Close channels to instances no longer in the view."""
        keep = set(addresses)
        for address in [a for a in self._conns if a not in keep]:
            await self._conns.pop(address).channel.close(grace=None)

    async def close(self) -> None:
        await self.retain(())


@dataclass(slots=True)
class DecodeCall:
    """A running Decode stream; ``first`` waits for its first event under a deadline."""

    call: grpc.aio.UnaryStreamCall
    first_timeout_s: float

    async def first(self) -> decode_pb2.DecodeEvent | None:
        ev = await asyncio.wait_for(self.call.read(), self.first_timeout_s)
        return None if ev is grpc.aio.EOF else ev

    async def rest(self) -> AsyncIterator[decode_pb2.DecodeEvent]:
        while True:
            ev = await self.call.read()
            if ev is grpc.aio.EOF:
                return
            yield ev

    def cancel(self) -> None:
        self.call.cancel()
