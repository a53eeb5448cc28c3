"""Running one kvstore process: warehouse + gRPC server + metrics + registry
heartbeats, drained gracefully on SIGTERM/SIGINT (``kvserve store serve``).

Startup prints ``kvstore ready <host>:<port>`` on stdout once the server
answers, so a launcher that asked for port 0 learns the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing import resource_tracker

from common import exit_watchdog
from common.config import KVServeConfig
from kvstore.integrity import block_mac
from kvstore.memtune import tune_malloc
from kvstore.redis_server import EmbeddedRedis
from kvstore.registry import InstanceInfo, InstanceRegistry, LoadReport
from kvstore.service import ServiceLimits, start_server
from kvstore.warehouse import Warehouse, WarehouseConfig
from security.config import SecurityConfig
from security.redact import register_secret
from security.secret_files import refuse_placeholder
from telemetry import tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoreOptions:
    config: KVServeConfig = field(default_factory=KVServeConfig)
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = -1          # -1: none; 0: any free port
    redis_url: str = ""             # empty: config/REDIS_URL, else an embedded server
    advertise: str = ""             # address published in the registry; default host:port
    grace_s: float = 10.0
    sweep_interval_s: float = 300.0
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    fsync: bool = True
    prefault_g2: bool = True
    security: SecurityConfig | None = None   # None: from the environment (KVSERVE_TLS_DIR)
    health_port: int = -1                    # plain-text health-only port for probes
    integrity_key_file: str = ""             # block MAC key; default: from the secret

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or self.metrics_port > 65535:
            raise ValueError("ports must be in 0..65535")
        if self.grace_s < 0:
            raise ValueError("grace_s must be >= 0")


def warehouse_config(opts: StoreOptions, redis_url: str) -> WarehouseConfig:
    cfg = opts.config
    return WarehouseConfig(redis_url=redis_url, tiers=cfg.tiers, classes=cfg.classes,
                           hit_rule=cfg.blocks, sweep_interval_s=opts.sweep_interval_s,
                           fsync=opts.fsync, prefault_g2=opts.prefault_g2,
                           mac=block_mac(opts.security, opts.integrity_key_file),
                           quotas=cfg.quotas, whatif=cfg.whatif)


# The object store's credentials, as Kubernetes hands them to the kvstore (k8s/components/s3-g4).
OBJECT_STORE_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def check_object_store_secrets(g4_url: str) -> None:
    """With a G4 URL, the object store's credentials in the environment must be
    real ones (a shipped ``CHANGE-ME`` refuses to start, naming the variable);
    they are registered for redaction."""
    if not g4_url:
        return
    for name in OBJECT_STORE_SECRETS:
        value = os.environ.get(name)
        if value is not None:
            refuse_placeholder(value, f"${name} (G4 credentials)")
            register_secret(value)


async def run_store(opts: StoreOptions) -> int:
    check_object_store_secrets(opts.config.tiers.g4_url)
    embedded: EmbeddedRedis | None = None
    url = opts.redis_url or opts.config.redis.effective_url()
    if not url:
        embedded = EmbeddedRedis().start()
        url = embedded.url
        log.info("no Redis configured: started an embedded one at %s:%d", embedded.host,
                 embedded.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tracing.setup("kvstore")
    wh = await Warehouse(warehouse_config(opts, url)).start()
    running = await start_server(wh, host=opts.host, port=opts.port, limits=opts.limits,
                                 security=opts.security, health_port=opts.health_port)
    metrics = wh.metrics.serve(opts.metrics_port, opts.host) if opts.metrics_port >= 0 else None
    address = opts.advertise or f"{opts.host}:{running.port}"
    instance = f"kvstore-{wh.node}"
    router_cfg = opts.config.router
    registry = InstanceRegistry(url, ttl_s=router_cfg.instance_ttl_s)
    info = InstanceInfo(instance, "kvstore", address, node=wh.node,
                        capacity=float(opts.config.tiers.g2_bytes))
    await registry.register(info)
    beat = asyncio.create_task(_heartbeats(registry, info, wh, router_cfg.heartbeat_s))
    extra = f" metrics :{metrics.port}" if metrics else ""
    if running.health_port >= 0:
        extra += f" health :{running.health_port}"
    print(f"kvstore ready {opts.host}:{running.port}{extra}", flush=True)
    try:
        await stop.wait()
        log.info("draining: health NOT_SERVING, finishing in-flight calls")
        wh.accepting = False
        await running.drain(opts.grace_s)
    finally:
        exit_watchdog.arm("kvstore", opts.grace_s)
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        with contextlib.suppress(Exception):
            await registry.deregister(instance)
        await registry.close()
        await wh.close()
        if metrics is not None:
            metrics.close()
        if embedded is not None:
            embedded.stop()
    return 0


async def _heartbeats(registry: InstanceRegistry, info: InstanceInfo, wh: Warehouse,
                      every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            g2 = wh.tiers.get("G2")
            load = 0.0
            if g2 is not None and g2.capacity_bytes:
                load = g2.stats().used_bytes / g2.capacity_bytes
            if not await registry.heartbeat(info.instance_id, LoadReport(load=load)):
                await registry.register(info)
            wh.ops.redis_up.set(1)
        except Exception:  # Redis hiccup: try again next beat
            wh.ops.redis_up.set(0)
            log.warning("registry heartbeat failed", exc_info=True)


def main(opts: StoreOptions) -> int:
    tune_malloc()
    exit_watchdog.enable()            # this process is the store: bound its stop
    # Fork the shared-memory tracker now, while this process has one thread: forked
    # later, beside gRPC's poller threads, it once aborted a starting store (epoll EBADF).
    resource_tracker.ensure_running()
    os.umask(0o077)   # whatever a library creates for us (G4 on a mount, temp files) is private
    try:
        return asyncio.run(run_store(opts))
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout.flush()
