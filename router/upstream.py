"""gRPC calls from the router to prefill and decode instances.

One ``grpc.aio`` channel per instance address, opened on first use and closed
when the instance leaves the live view. Prefill and Decode carry what is left
of the request's end-to-end budget as their gRPC deadline (the services see it
as ``context.time_remaining()``): no per-hop timer can end finished work that
the client still waits for. Errors surface as ``grpc.aio.AioRpcError``;
``router.errors.upstream_error`` decides what they mean for the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc

from common.grpc_keepalive import client_keepalive
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from security.config import SecurityConfig

_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
    # Find a dead peer fast: the router must stop waiting on a killed instance.
    *client_keepalive(),
    ("grpc.enable_retries", 0),
)


@dataclass(frozen=True, slots=True)
class CallTimeouts:
    release_s: float = 2.0           # Release is housekeeping, not the request's work

    def __post_init__(self) -> None:
        if self.release_s <= 0:
            raise ValueError("CallTimeouts.release_s must be > 0")


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

    async def prefill(self, address: str, req: prefill_pb2.PrefillRequest, *,
                      budget_s: float) -> prefill_pb2.KVHandle:
        return await self._conn(address, "prefill").prefill.Prefill(
            req, timeout=max(0.001, budget_s))

    async def release(self, handle: prefill_pb2.KVHandle) -> None:
        """Best effort: the prefill instance drops KV nobody pulls when it needs room."""
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await self._conn(handle.prefill_address, "prefill").prefill.Release(
                prefill_pb2.ReleaseRequest(request_id=handle.ctx.request_id),
                timeout=self.timeouts.release_s)

    def decode(self, address: str, handle: prefill_pb2.KVHandle,
               sampling: common_pb2.SamplingParams, *, budget_s: float,
               local_tail_tokens: int = 0) -> DecodeCall:
        """``local_tail_tokens`` > 0: ``handle`` is no prefill's (prompt and context
        only); the instance computes the prompt from its own G1 or declines."""
        call = self._conn(address, "decode").decode.Decode(
            decode_pb2.DecodeRequest(handle=handle, sampling=sampling,
                                     local_tail_tokens=local_tail_tokens),
            timeout=max(0.001, budget_s))
        return DecodeCall(call)

    async def retain(self, addresses: Iterable[str]) -> None:
        """Close channels to instances no longer in the view."""
        keep = set(addresses)
        for address in [a for a in self._conns if a not in keep]:
            await self._conns.pop(address).channel.close(grace=None)

    async def close(self) -> None:
        await self.retain(())


@dataclass(slots=True)
class DecodeCall:
    """A running Decode stream (under the request's deadline)."""

    call: grpc.aio.UnaryStreamCall

    async def first(self) -> decode_pb2.DecodeEvent | None:
        ev = await self.call.read()
        return None if ev is grpc.aio.EOF else ev

    async def rest(self) -> AsyncIterator[decode_pb2.DecodeEvent]:
        while True:
            ev = await self.call.read()
            if ev is grpc.aio.EOF:
                return
            yield ev

    def cancel(self) -> None:
        self.call.cancel()
