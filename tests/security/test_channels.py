"""The deployment's gRPC channels (security.config) connect to a server whose TLS
handshake is slow, as a loaded host makes it: a real mTLS server behind a TCP
relay that holds the server's first flight back.

The flaky-test hunt behind it: a warehouse poll failed once in a loaded suite
with UNAVAILABLE "Handshake read failed (Endpoint closing)". That message is the
client's own endpoint being shut down mid-handshake (a server that closes reads
as "Socket closed"): the channels' defaults gave one connection attempt 100 ms
(gRPC reads ``grpc.min_reconnect_backoff_ms`` as that deadline), so every
attempt on a slow handshake was cut off by the client, again and again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from security.config import SecurityConfig

HANDSHAKE_DELAY_S = 0.4


@contextlib.asynccontextmanager
async def slow_handshake_relay(server_port: int, delay_s: float) -> AsyncIterator[int]:
    """A TCP relay to ``server_port`` that holds each connection's first bytes from
    the server for ``delay_s`` (the TLS ServerHello arrives late); the relay's port."""
    tasks: set[asyncio.Task[None]] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                    delay = 0.0
                w.write(data)
                await w.drain()
        w.close()

    async def on_conn(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", server_port)
        for t in (pipe(cr, sw, 0.0), pipe(sr, cw, delay_s)):
            task = asyncio.create_task(t)
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    relay = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    try:
        yield relay.sockets[0].getsockname()[1]
    finally:
        relay.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _check(port: int, options: list[tuple[str, object]]) -> grpc.StatusCode:
    ch = SecurityConfig.from_env("operator").aio_channel(f"127.0.0.1:{port}", "kvstore",
                                                         options)
    try:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await ch.close()


@pytest.mark.timeout(60)
def test_a_channel_connects_through_a_slow_tls_handshake() -> None:
    async def run() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = SecurityConfig.from_env("kvstore").add_port(server, "127.0.0.1:0")
        await server.start()
        try:
            async with slow_handshake_relay(port, HANDSHAKE_DELAY_S) as relay_port:
                deployment = await _check(relay_port, [])
                # The old default: proves the relay really slows the handshake
                # past what that attempt deadline allowed.
                cut_off = await _check(relay_port, [("grpc.min_reconnect_backoff_ms", 100)])
        finally:
            await server.stop(None)
        return deployment, cut_off

    deployment, cut_off = asyncio.run(run())
    assert deployment == grpc.StatusCode.OK
    assert cut_off == grpc.StatusCode.UNAVAILABLE
