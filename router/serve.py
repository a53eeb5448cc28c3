"""One router process: the HTTP front and the gRPC Router service over one core.

``serve(cfg)`` loads the model's tokenizer and config (no weights), starts the
live view (registry + KV events), binds the gRPC server (Router, health,
reflection) and the aiohttp front, registers the router in the instance
registry, prints a ready line, and on SIGTERM drains: health NOT_SERVING,
leave the registry, stop accepting, let in-flight requests finish for up to
``drain_grace_s``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from dataclasses import dataclass, field, replace

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import exit_watchdog
from common.config import AdmissionSection, ConfigError, HitRule, TrafficClasses
from common.grpc_keepalive import server_keepalive
from kvstore.registry import InstanceInfo, LoadReport
from proto import router_pb2_grpc
from router.admission import Admission, Capacity
from router.auth import DEFAULT_TENANT, ApiKeys
from router.backends import make_backend
from router.cluster_ops import ClusterOps, operator_key
from router.core import CoreConfig, RouterCore
from router.front import FrontConfig, make_app
from router.front_runner import FrontRunner
from router.live_view import LiveView, ViewConfig
from router.metrics import RouterMetrics
from router.model_meta import load_model_meta
from router.service import SERVICE_NAME, RouterService
from router.tokenize_http import TokenizeEndpoints
from router.upstream import CallTimeouts, Upstreams
from security.authz import AuthInterceptor
from security.config import SecurityConfig
from security.grpc_input import InputGuard
from security.health_port import start_health_port
from service.hosting import READY_PREFIX, Heartbeat, stop_event_on_signals
from telemetry import tracing
from telemetry.grpc_hooks import server_interceptors

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str = "smollm2"
    served_name: str = ""            # default: the model name (directory name for paths)
    host: str = "127.0.0.1"
    grpc_port: int = 50054           # 0 = any free port
    http_port: int = 8000            # 0 = any free port
    redis_url: str = ""
    node: str = "node-0"
    instance_id: str = ""
    api_key_file: str = ""
    hit_rule: HitRule = field(default_factory=HitRule)
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    view: ViewConfig = field(default_factory=ViewConfig)
    core: CoreConfig = field(default_factory=CoreConfig)
    timeouts: CallTimeouts = field(default_factory=CallTimeouts)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    drain_grace_s: float = 10.0
    max_body_bytes: int = 16 * 2**20
    security: SecurityConfig | None = None   # mTLS + deployment secret; None: the environment
    health_port: int = -1                    # plain-text health-only gRPC port (probes)
    backend: str = "engine"                  # router.backends: "engine" or "vllm"

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"router {name} must be in 0..65535, got {getattr(self, name)}")
        if not self.redis_url:
            raise ConfigError("the router needs a Redis URL (--redis-url, [redis].url or "
                              "REDIS_URL): instances are found through the registry")
        if not self.core.block_tokens == self.hit_rule.block_tokens == (
                self.view.hit_rule.block_tokens):
            raise ConfigError("router core.block_tokens, view.hit_rule and blocks.block_tokens "
                              "must agree")
        if self.drain_grace_s < 0:
            raise ConfigError("router drain_grace_s must be >= 0")


@dataclass(slots=True)
class RunningRouter:
    """Handles of a started router (tests drive it in-process through this)."""

    core: RouterCore
    view: LiveView
    upstreams: Upstreams
    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    http_runner: web.AppRunner
    heartbeat: Heartbeat
    grpc_port: int
    http_port: int
    instance_id: str
    health_server: grpc.aio.Server | None = None
    health_port: int = -1

    async def stop(self, grace_s: float) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.heartbeat.stop()
        await self.http_runner.shutdown()
        await asyncio.gather(self.grpc_server.stop(grace_s), self.http_runner.cleanup())
        await self.view.stop()
        await self.upstreams.close()
        if self.core.ops is not None:
            await self.core.ops.close()
        if self.health_server is not None:
            await self.health_server.stop(None)


async def start_router(cfg: RouterConfig) -> RunningRouter:
    tracing.setup("router", instance=cfg.instance_id)     # before any channel is made
    meta = load_model_meta(cfg.model, served_name=cfg.served_name)
    api_keys = ApiKeys.load(cfg.api_key_file) if cfg.api_key_file else ApiKeys()
    warn_if_open(cfg.host, api_keys)
    # The model decides the hit rule's reserve (sliding-window models keep more).
    rule = meta.config.hit_rule(cfg.hit_rule.block_tokens)
    metrics = RouterMetrics()
    metrics.set_hit_rule(rule)
    view = LiveView(cfg.redis_url, replace(cfg.view, hit_rule=rule), metrics)
    await view.start()
    security = cfg.security or SecurityConfig.from_env("router")
    upstreams = Upstreams(cfg.timeouts, security)
    view.on_change(upstreams.retain)
    admission = _admission(cfg.admission, view, metrics)
    secret = security.require_secret()
    core = RouterCore(replace(cfg.core, secret=secret), meta, view, upstreams, metrics, admission)
    metrics.enable_vllm_series(meta.served_name)
    ops = ClusterOps(view, metrics, security)
    core.ops = ops
    backend = make_backend(cfg.backend, core)   # the fronts' one seam (router.backends)

    # Tenants and operators may call the Router API (security/methods.py); the
    # tenant of a call comes from its identity or API key (router.service).
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20),
                                      ("grpc.max_send_message_length", 64 * 2**20),
                                      ("grpc.so_reuseport", 0),   # taken port: fail, not share
                                      *server_keepalive()],
                             interceptors=[*server_interceptors(),
                                           AuthInterceptor(insecure=security.insecure),
                                           InputGuard()])
    router_pb2_grpc.add_RouterServicer_to_server(
        RouterService(backend, classes=cfg.classes, api_keys=api_keys), server)  # type: ignore[arg-type]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    try:
        grpc_port = security.add_port(server, f"{cfg.host}:{cfg.grpc_port}")
    except RuntimeError:                 # grpc's "Failed to bind" (port taken)
        grpc_port = 0
    if grpc_port == 0:
        await view.stop()
        await upstreams.close()
        raise OSError(f"cannot serve gRPC on {cfg.host}:{cfg.grpc_port}: address in use or "
                      "not available")
    await server.start()
    probe = await start_health_port(health_servicer, cfg.host, cfg.health_port)

    front_cfg = FrontConfig(model_name=meta.served_name, max_context=meta.max_context,
                            vocab_size=meta.vocab_size, classes=cfg.classes, api_keys=api_keys,
                            max_body_bytes=cfg.max_body_bytes,
                            operator_key=operator_key(secret), operator_open=security.insecure)
    tok_http = TokenizeEndpoints(meta.tokenizer, meta.served_name, meta.max_context,
                                 meta.vocab_size)
    runner = FrontRunner(make_app(front_cfg, backend, metrics, ops, tok_http), access_log=None,
                         shutdown_timeout=cfg.drain_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.http_port)
    try:
        await site.start()
    except OSError as exc:
        # Undo what started, or the gRPC server and the view keep the loop
        # (and the process) alive after the error.
        await runner.cleanup()
        await server.stop(None)
        if probe is not None:
            await probe[0].stop(None)
        await view.stop()
        await upstreams.close()
        raise OSError(f"cannot serve HTTP on {cfg.host}:{cfg.http_port}: "
                      f"{exc.strerror or exc}") from exc
    http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    instance_id = cfg.instance_id or f"router-{cfg.host}:{grpc_port}"
    heartbeat = Heartbeat(
        cfg.redis_url,
        InstanceInfo(instance_id=instance_id, role="router", address=f"{cfg.host}:{grpc_port}",
                     node=cfg.node),
        lambda: LoadReport(queue=metrics.in_flight_now),
        interval_s=cfg.view.heartbeat_s, ttl_s=cfg.view.instance_ttl_s)
    await heartbeat.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningRouter(core, view, upstreams, server, health_servicer, runner, heartbeat,
                         grpc_port, http_port, instance_id, *(probe or (None, -1)))


def _admission(cfg: AdmissionSection, view: LiveView, metrics: RouterMetrics) -> Admission:
    """The admission layer, its capacity the view's live instances (router.admission)."""
    def capacity() -> Capacity:
        counts = view.live_counts()
        return Capacity(prefill=counts.get("prefill", 0), decode=counts.get("decode", 0))

    admission = Admission(cfg, capacity, metrics)

    async def instances_changed(_: object) -> None:
        admission.pump()                 # a new instance is room for waiting requests

    view.on_change(instances_changed)
    return admission


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False                  # a name or a wildcard: reachable from elsewhere


def warn_if_open(host: str, api_keys: ApiKeys) -> bool:
    """Logs (and returns True) when the fronts listen beyond loopback with no API
    keys: every HTTP client is then the one tenant ``default``."""
    if api_keys.enabled or is_loopback(host):
        return False
    log.warning("SECURITY: the router listens on %s with no API keys (--api-key-file): every "
                "HTTP client acts as the one tenant %r and shares its cache; give each tenant "
                "a key (docs/security.md)", host, DEFAULT_TENANT)
    return True


def ready_line(r: RunningRouter) -> str:
    """What a launcher or test waits for on stdout."""
    return READY_PREFIX + json.dumps({"role": "router", "instance_id": r.instance_id,
                                      "port": r.grpc_port, "http_port": r.http_port},
                                     sort_keys=True)


async def serve(cfg: RouterConfig) -> None:
    stop = stop_event_on_signals()
    running = await start_router(cfg)
    try:
        print(ready_line(running), flush=True)
        log.info("router serving HTTP on %s:%d, gRPC on %s:%d", cfg.host, running.http_port,
                 cfg.host, running.grpc_port)
        await stop.wait()
        log.info("router draining (grace %.1fs)", cfg.drain_grace_s)
    finally:
        # A drain that cannot finish (its Redis or peers already gone, e.g. after the
        # launcher was kill -9'ed) must not keep the process alive past SIGTERM.
        exit_watchdog.arm("router", cfg.drain_grace_s)
        await running.stop(cfg.drain_grace_s)
