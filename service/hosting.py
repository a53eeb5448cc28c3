"""What every kvserve engine service does around its servicer: a grpc.aio
server with raised message limits, the standard health service and
reflection, registration and heartbeats in the instance registry, and a
graceful drain on SIGTERM (health NOT_SERVING, deregister, stop with grace).
Shared by the prefill and decode services.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import exit_watchdog
from common.grpc_keepalive import client_keepalive, server_keepalive
from kvstore.registry import InstanceInfo, InstanceRegistry, LoadReport
from security.authz import AuthInterceptor
from security.grpc_input import InputGuard
from security.health_port import start_health_port
from service.config import Endpoint, EngineSpec
from service.metrics import Source, serve_metrics
from telemetry import tracing
from telemetry.grpc_hooks import server_interceptors

log = logging.getLogger(__name__)
# Calls a server runs at once; beyond it gRPC answers RESOURCE_EXHAUSTED before any
# handler runs, so a flood of calls cannot exhaust the process (the services' own
# bounded queues answer "busy" well before this: contracts, "Busy instance").
MAX_CONCURRENT_RPCS = 1024


def server_options(endpoint: Endpoint) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),       # a taken port fails the bind, never shares it
        ("grpc.max_send_message_length", endpoint.max_message_bytes),
        ("grpc.max_receive_message_length", endpoint.max_message_bytes),
        *server_keepalive(),
    ]


def channel_options(endpoint: Endpoint) -> list[tuple[str, int]]:
    """Client side: same limits; find dead peers fast and reconnect fast."""
    return [
        ("grpc.max_send_message_length", endpoint.max_message_bytes),
        ("grpc.max_receive_message_length", endpoint.max_message_bytes),
        *client_keepalive(),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.enable_retries", 0),
    ]


@dataclass(slots=True)
class HostedServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    health_server: grpc.aio.Server | None = None    # plain-text health-only port (probes)
    health_port: int = -1

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self.health.set(name, status)


class EngineService(Protocol):
    """What ``run_service`` needs from a prefill or decode servicer."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def load_report(self) -> LoadReport: ...
    def metric_sources(self) -> dict[str, Source]: ...


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    role: str                                       # "prefill" | "decode"
    service_name: str                               # e.g. "kvserve.v1.Prefill"
    make: Callable[[str], EngineService]            # address -> servicer
    add: Callable[[Any, grpc.aio.Server], None]     # add_XServicer_to_server
    fingerprint: str
    capacity: float


@dataclass(frozen=True, slots=True)
class Ready:
    role: str
    instance_id: str
    address: str
    port: int
    metrics_port: int
    health_port: int = -1

    def line(self) -> str:
        """The line a launcher or test waits for on stdout."""
        return READY_PREFIX + json.dumps(asdict(self), sort_keys=True)


READY_PREFIX = "KVSERVE_READY "


async def start_server(endpoint: Endpoint, spec: ServiceSpec
                       ) -> tuple[HostedServer, EngineService, str]:
    """Bind, build the servicer with its dial address, start, mark SERVING."""
    security = endpoint.security_for(spec.role)
    tracing.setup(spec.role, instance=endpoint.instance_id)   # before any channel is made
    server = grpc.aio.server(options=server_options(endpoint), interceptors=[
        *server_interceptors(), AuthInterceptor(insecure=security.insecure), InputGuard()],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    port = security.add_port(server, f"{endpoint.host}:{endpoint.port}")
    if port == 0:
        raise OSError(f"cannot bind {endpoint.host}:{endpoint.port}")
    address = f"{endpoint.dial_host()}:{port}"
    service = spec.make(address)
    spec.add(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (spec.service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    await service.start()
    await server.start()
    probe = await start_health_port(health_servicer, endpoint.host, endpoint.health_port)
    hosted = HostedServer(server, port, health_servicer, (spec.service_name,),
                          *(probe or (None, -1)))
    await hosted.set_serving(True)
    return hosted, service, address


async def run_service(endpoint: Endpoint, spec: ServiceSpec, *,
                      stop: asyncio.Event | None = None,
                      on_ready: Callable[[Ready], None] | None = None) -> None:
    """Serve until ``stop`` is set (default: SIGTERM/SIGINT), then drain."""
    stop = stop or stop_event_on_signals()
    hosted, service, address = await start_server(endpoint, spec)
    instance_id = endpoint.instance_id or f"{spec.role}-{address}"
    heartbeat = Heartbeat(
        endpoint.redis_url,
        InstanceInfo(instance_id=instance_id, role=spec.role, address=address,
                     node=endpoint.node, model_fingerprint=spec.fingerprint,
                     capacity=spec.capacity),
        service.load_report, interval_s=endpoint.heartbeat_s, ttl_s=endpoint.instance_ttl_s)
    try:
        await heartbeat.start()
        metrics_port = -1
        if endpoint.metrics_port >= 0:
            metrics_port = serve_metrics(f"kvserve_{spec.role}", service.metric_sources(),
                                         host=endpoint.host, port=endpoint.metrics_port)
        ready = Ready(spec.role, instance_id, address, hosted.port, metrics_port,
                      hosted.health_port)
        log.info("%s serving on %s", spec.role, address)
        if on_ready is not None:
            on_ready(ready)
        await stop.wait()
        log.info("%s draining (grace %.1fs)", spec.role, endpoint.drain_grace_s)
    finally:
        exit_watchdog.arm(spec.role, endpoint.drain_grace_s)
        await drain(hosted, heartbeat, endpoint.drain_grace_s)
        await service.close()


class Heartbeat:
    """Registers the instance and keeps it alive; tolerates Redis outages
    (logged, retried next beat) and re-registers after expiry."""

    def __init__(self, redis_url: str, info: InstanceInfo, report: Callable[[], LoadReport],
                 *, interval_s: float, ttl_s: float) -> None:
        self._registry = InstanceRegistry(redis_url, ttl_s=ttl_s) if redis_url else None
        self.info = info
        self._report = report
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._registry is None:
            return
        await self._registry.register(self.info)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")

    async def _run(self) -> None:
        assert self._registry is not None
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                if not await self._registry.heartbeat(self.info.instance_id, self._report()):
                    await self._registry.register(self.info)
                    await self._registry.heartbeat(self.info.instance_id, self._report())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: keep serving, retry next beat
                log.warning("heartbeat of %s failed: %s", self.info.instance_id, exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.deregister(self.info.instance_id)
            await self._registry.close()


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the process then drains and exits)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def drain(hosted: HostedServer, heartbeat: Heartbeat, grace_s: float) -> None:
    """Health NOT_SERVING first (balancers stop sending), leave the registry,
    then let in-flight calls finish for up to ``grace_s``."""
    await hosted.set_serving(False)
    await heartbeat.stop()
    await hosted.server.stop(grace_s)
    if hosted.health_server is not None:
        await hosted.health_server.stop(None)


def serve_engine_service(role: str, service_name: str, engine_spec: EngineSpec,
                         endpoint: Endpoint, make: Callable[[Any, str], EngineService],
                         add: Callable[[Any, grpc.aio.Server], None]) -> int:
    """The body of ``kvserve prefill|decode serve``: load the engine, serve
    until SIGTERM, print the ready line for launchers."""
    from engine import Engine

    exit_watchdog.enable()             # this process is the service: bound its stop
    # Attaching the store's shared memory starts Python's tracker by fork: do it now,
    # with one thread, not later beside gRPC's pollers (a fork there can abort us).
    resource_tracker.ensure_running()
    engine = Engine(engine_spec.engine_config())
    log.info("%s engine: %s %s on %s, fingerprint %s", role, engine_spec.model,
             engine.layout.name, engine_spec.device, engine.fingerprint_hex)
    spec = ServiceSpec(role=role, service_name=service_name,
                       make=lambda address: make(engine, address), add=add,
                       fingerprint=engine.fingerprint_hex, capacity=float(engine_spec.num_blocks))
    asyncio.run(run_service(endpoint, spec, on_ready=lambda r: print(r.line(), flush=True)))
    return 0
