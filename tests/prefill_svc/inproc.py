"""The Prefill service in-process over a real gRPC socket (mTLS from the test
session's deployment), for tests that look at the service object as well."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from engine import Engine
from prefill_svc.config import PrefillConfig
from prefill_svc.server import SERVICE_NAME, PrefillService
from proto import prefill_pb2_grpc
from service.hosting import ServiceSpec, run_service
from tests.tls import aio_channel

Serving = AbstractAsyncContextManager[tuple[prefill_pb2_grpc.PrefillStub, PrefillService]]


@asynccontextmanager
async def serve_prefill(config: PrefillConfig) -> AsyncIterator[
        tuple[prefill_pb2_grpc.PrefillStub, PrefillService]]:
    engine = Engine(config.engine.engine_config())
    made: list[PrefillService] = []

    def make(address: str) -> PrefillService:
        made.append(PrefillService(config, engine, address=address))
        return made[0]

    stop = asyncio.Event()
    ready: list[str] = []
    spec = ServiceSpec("prefill", SERVICE_NAME, make,
                       prefill_pb2_grpc.add_PrefillServicer_to_server, engine.fingerprint_hex, 256)
    task = asyncio.create_task(run_service(config.endpoint, spec, stop=stop,
                                           on_ready=lambda r: ready.append(r.address)))
    try:
        while not ready:
            await asyncio.sleep(0.01)
        async with aio_channel(ready[0]) as ch:
            yield prefill_pb2_grpc.PrefillStub(ch), made[0]
    finally:
        stop.set()
        await task
