"""``kvserve vllm-attach``: put a plain vLLM server (no kvserve connector) behind
kvserve's router.

A sidecar beside the server: it registers the server in kvserve's instance
registry (role ``prefill``, its OpenAI URL, its vLLM KV-event endpoint, the
model fingerprint the connector would compute), signed by the instance's own
``engine`` identity (``security.attest``), and heartbeats it with the load the
server reports on ``/metrics`` (requests running and waiting). The router then
places requests on it by cache affinity learned from the server's own KV
events (``router.vllm_events``) and by load. When the server stops answering
``/health`` the sidecar stops heartbeating and the entry expires.

The server must run with ``--kv-events-config`` (ZMQ publisher) and the same
``--block-size``-compatible settings the router uses (any vLLM block size maps,
``router.vllm_events``), and — outside ``--insecure`` — HTTPS with a certificate
of the deployment CA and the deployment's API key (docs/vllm.md, "Trust").
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from connectors.vllm_entry import attested
from kvstore.registry import InstanceInfo, InstanceRegistry, LoadReport
from security.config import SecurityConfig

log = logging.getLogger(__name__)
_METRIC = re.compile(r"^(vllm:num_requests_(?:running|waiting))\{[^}]*\}\s+([0-9.eE+-]+)\s*$",
                     re.M)


@dataclass(frozen=True, slots=True)
class AttachConfig:
    url: str                         # the server's OpenAI base URL
    instance_id: str
    redis_url: str
    model_fingerprint: str           # hex, as the connector computes it
    kv_events: str = ""              # the server's ZMQ endpoint, as the router dials it
    node: str = "node-0"
    capacity_requests: int = 64
    heartbeat_s: float = 1.0
    ttl_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must be http(s)://host:port")
        if not re.fullmatch(r"[0-9a-f]{32}", self.model_fingerprint):
            raise ValueError("model_fingerprint must be 32 lowercase hex digits")
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ValueError("ttl_s must exceed heartbeat_s > 0")
        if self.capacity_requests < 1:
            raise ValueError("capacity_requests must be >= 1")


def parse_load(metrics_text: str) -> tuple[int, int]:
    """(running, waiting) from vLLM's Prometheus text."""
    got = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for name, value in _METRIC.findall(metrics_text):
        got[name] += float(value)
    return int(got["vllm:num_requests_running"]), int(got["vllm:num_requests_waiting"])


def _get(url: str, ctx: ssl.SSLContext | None, timeout_s: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=ctx) as resp:
            return resp.read().decode(errors="replace") if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


async def run_attach(cfg: AttachConfig, security: SecurityConfig, stop: asyncio.Event) -> None:
    from security.https import client_context

    ctx = client_context(security)
    info = attested(InstanceInfo(instance_id=cfg.instance_id, role="prefill", address=cfg.url,
                                 node=cfg.node, model_fingerprint=cfg.model_fingerprint,
                                 capacity=float(cfg.capacity_requests),
                                 kv_events=cfg.kv_events), security)
    reg = InstanceRegistry(cfg.redis_url, ttl_s=cfg.ttl_s)
    registered = False
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            healthy = await asyncio.to_thread(_get, cfg.url + "/health", ctx) is not None
            if healthy:
                text = await asyncio.to_thread(_get, cfg.url + "/metrics", ctx) or ""
                running, waiting = parse_load(text)
                report = LoadReport(load=min(1.0, running / cfg.capacity_requests),
                                    queue=waiting, tokens_in_flight=0)
                if not registered or not await reg.heartbeat(cfg.instance_id, report):
                    await reg.register(info)
                    await reg.heartbeat(cfg.instance_id, report)
                    if not registered:
                        log.info("attached %s (%s) to the registry", cfg.instance_id, cfg.url)
                    registered = True
            elif registered:
                log.warning("%s stopped answering /health: letting its entry expire",
                            cfg.instance_id)
                registered = False
            wait = max(0.05, cfg.heartbeat_s / 2 - (time.monotonic() - t0))
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except TimeoutError:
                continue
        if registered:
            await reg.deregister(cfg.instance_id)
    finally:
        await reg.close()
