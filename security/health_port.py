"""A plain-text port that answers only the standard health service.

Kubernetes' gRPC probes cannot present a client certificate, so every
kvserve server can expose its health servicer (the same object, so the same
SERVING / NOT_SERVING state) on a second port with nothing else on it:
no kvserve method, no reflection. What it reveals is whether the process is
serving, which the pod status shows anyway.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from security.grpc_input import InputGuard


async def start_health_port(health: health_aio.HealthServicer, host: str,
                            port: int) -> tuple[grpc.aio.Server, int] | None:
    """Serve ``health`` alone on ``host:port`` (0 = any free port); None when
    ``port`` is negative (no health port)."""
    if port < 0:
        return None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],  # taken port: fail the bind
                             interceptors=[InputGuard()])       # garbage: INVALID_ARGUMENT
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the health port {host}:{port}")
    await server.start()
    return server, bound


__all__ = ["start_health_port"]
