"""Run as a process with OTEL_* pointing at a receiver: a traced gRPC call
through the real hooks (client interceptors on a ``SecurityConfig`` channel,
the server interceptor on a grpc.aio server), plus ``span`` and ``record``.
Prints the client span's traceparent, then flushes the exporter."""

from __future__ import annotations

import asyncio
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from security.config import SecurityConfig
from telemetry import tracing
from telemetry.grpc_hooks import server_interceptors


async def main() -> None:
    assert tracing.setup(sys.argv[1])
    server = grpc.aio.server(interceptors=server_interceptors())
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with SecurityConfig(insecure=True).aio_channel(f"127.0.0.1:{port}", "") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        await stub.Check(health_pb2.HealthCheckRequest())       # outside a trace: no spans
        root = tracing.enter("request", {}, root=True)
        assert root is not None
        with tracing.span("work", blocks=3, secret_free="yes") as s:
            t = tracing.now()
            tracing.record("queue", t - 0.01, t, stage="test")
            await stub.Check(health_pb2.HealthCheckRequest())
            s.set(bytes=1024)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.NOT_FOUND
        print(tracing.traceparent(root.span), flush=True)
        root.leave()
    await server.stop(None)
    tracing.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
