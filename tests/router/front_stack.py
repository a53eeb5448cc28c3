"""Real stacks for the router-front tests: separate service processes
(tests/prefill_svc/procs.py) plus a router, and a small HTTP helper that never
raises on 4xx/5xx."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.redis_server import EmbeddedRedis, free_port
from tests.prefill_svc.procs import Proc, engine_service, healthy, start_all, store, write_config
from tests.redis_args import redis_args


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self.body)

    def events(self) -> list[str]:
        """SSE ``data:`` payloads in order."""
        return [line[len("data: "):] for line in self.body.decode().split("\n")
                if line.startswith("data: ")]


def http(method: str, url: str, body: bytes | dict | None = None,  # type: ignore[type-arg]
         headers: dict[str, str] | None = None, timeout: float = 60.0) -> Reply:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, dict(r.headers), r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, dict(e.headers), e.read())


@dataclass(slots=True)
class RouterProc:
    """``kvserve router serve`` on free ports."""

    proc: Proc
    http_port: int
    extra: tuple[str, ...] = field(default=())

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return self.proc.address


def router_proc(config: Path, redis_url: str, log_dir: Path, *,
                extra: tuple[str, ...] = ()) -> RouterProc:
    port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "router", "serve", "--config", str(config),
            "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
            *redis_args(redis_url), *extra]
    return RouterProc(Proc("router", argv, port, log_dir / f"router-{port}.log"), http_port,
                      extra)


@dataclass(slots=True)
class SplitStack:
    """Redis, kvstore, prefill, decode and router processes (``split_stack``)."""

    router: RouterProc
    config: Path
    redis_url: str
    decode: Proc

    @property
    def http(self) -> str:
        return self.router.http

    @property
    def grpc(self) -> str:
        return self.router.grpc


TINY_MODEL, TINY_BLOCK = "tiny-dense", 16


@contextlib.contextmanager
def split_stack(d: Path, *, model: str, block_tokens: int,
                live_s: float) -> Iterator[SplitStack]:
    """What ``kvserve up`` starts, as separate processes: Redis, kvstore,
    prefill, decode and router, ready once the router sees both engines
    (within ``live_s``). Killed at the end: a graceful stop would only add
    seconds here."""
    config = write_config(d / "kvserve.toml", model=model, block_tokens=block_tokens)
    with EmbeddedRedis() as redis:
        st = store(config, redis.url, d)
        engines = [engine_service(role, config, redis.url, d, store_address=st.address)
                   for role in ("prefill", "decode")]
        router = router_proc(config, redis.url, d)
        procs = [st, *engines, router.proc]
        try:
            start_all(*procs)
            wait_until(lambda: _live(router.http) == {"prefill": 1, "decode": 1}, live_s,
                       "router sees prefill and decode")
            yield SplitStack(router, config, redis.url, engines[1])
        finally:
            for p in procs:
                p.kill()


@contextlib.contextmanager
def tiny_stack(d: Path) -> Iterator[SplitStack]:
    """``split_stack`` serving tiny-dense (byte-level tokenizer, 1024-token
    context) with 16-token blocks."""
    with split_stack(d, model=TINY_MODEL, block_tokens=TINY_BLOCK, live_s=30) as s:
        yield s


def _live(http_base: str) -> dict[str, int]:
    try:
        return live_counts(http_base)
    except OSError:                   # the HTTP port a moment after gRPC health
        return {}


def wait_until(cond: object, timeout_s: float, what: str, step_s: float = 0.05) -> float:
    """Poll ``cond()`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not within {timeout_s}s")
        time.sleep(step_s)
    return time.monotonic() - t0


def live_counts(http_base: str) -> dict[str, int]:
    return dict(http("GET", f"{http_base}/health").json()["instances"])


def metric_sum(http_base: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    body = http("GET", f"{http_base}/metrics").body.decode()
    total = 0.0
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


__all__ = ["Reply", "RouterProc", "SplitStack", "healthy", "http", "live_counts",
           "metric_sum", "router_proc", "tiny_stack", "wait_until"]
