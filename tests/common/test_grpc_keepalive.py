"""Every gRPC server of a deployment tolerates the keepalive pings its clients
send, so a call that waits long without data (a decode stream queued under
overload) never costs the connection: a server that takes the clients' pings
for abuse answers GOAWAY "too_many_pings" and fails every call on it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.grpc_keepalive import (
    KEEPALIVE_TIME_MS,
    MIN_RECV_PING_INTERVAL_MS,
    client_keepalive,
    server_keepalive,
)
from kvstore.limits import ServiceLimits
from router.upstream import _CHANNEL_OPTIONS
from service.config import Endpoint
from service.hosting import channel_options, server_options


def _min_recv(options: list[tuple[str, int]]) -> int:
    return dict(options).get("grpc.http2.min_ping_interval_without_data_ms", 300_000)


def _keepalive(options: list[tuple[str, int]] | tuple[tuple[str, int], ...]) -> int:
    return dict(options)["grpc.keepalive_time_ms"]


def test_every_server_accepts_every_clients_pings() -> None:
    servers = {"engine services": server_options(Endpoint()),
               "kvstore": ServiceLimits().grpc_options(), "shared": server_keepalive()}
    clients = {"router -> engines": _CHANNEL_OPTIONS,
               "engine -> engine": channel_options(Endpoint()), "shared": client_keepalive()}
    slowest_ok = min(_min_recv(o) for o in servers.values())
    fastest_ping = min(_keepalive(o) for o in clients.values())
    assert slowest_ok <= fastest_ping // 2 == MIN_RECV_PING_INTERVAL_MS, (servers, clients)
    assert fastest_ping == KEEPALIVE_TIME_MS


class _Idle(health.aio.HealthServicer):
    """Watch streams one update, then nothing until cancelled: a call with no data."""

    async def Watch(self, request, context):  # type: ignore[no-untyped-def,override]
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(3600)


@pytest.mark.parametrize("tolerant", [True, False])
def test_an_idle_stream_survives_keepalive_pings_only_where_tolerated(tolerant: bool) -> None:
    """Real sockets, periods scaled down 20x: a client pinging every 500 ms holds
    an idle stream for 4 s against a server accepting pings every 250 ms; the
    same against gRPC's default (5 minutes) loses the stream to GOAWAY."""
    ping_ms = 500

    async def run() -> grpc.StatusCode | None:
        opts = [("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_timeout_ms", 2000),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1)]
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)] + (
            [("grpc.http2.min_ping_interval_without_data_ms", ping_ms // 2)] if tolerant else []))
        health_pb2_grpc.add_HealthServicer_to_server(_Idle(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                await call.read()
                t_end = time.monotonic() + 4.0
                try:
                    await asyncio.wait_for(call.read(), max(0.1, t_end - time.monotonic()))
                except TimeoutError:
                    call.cancel()
                    return None            # still open: nothing broke it
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.UNKNOWN
        finally:
            await server.stop(None)

    code = asyncio.run(run())
    if tolerant:
        assert code is None
    else:
        assert code == grpc.StatusCode.UNAVAILABLE
