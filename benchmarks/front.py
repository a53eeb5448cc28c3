"""``kvserve bench front``: what the router front adds to time-to-first-token.

Starts Redis, a kvstore, one prefill, one decode and one router process, then
times, interleaved request by request on fresh (uncached) prompts of the same
length:

* **direct**: gRPC ``Prefill`` to the prefill instance, then ``Decode`` to the
  decode instance, until the first event (what an in-cluster client with its
  own placement would do);
* **router**: ``POST /v1/completions`` with ``stream: true`` through the HTTP
  front (validation, block keys, live view, placement, the same two calls, SSE)
  until the first ``data:`` event.

The difference of the medians is the front's overhead. It also times requests
the front rejects (a 400 from validation, no instance involved): the cost of
the HTTP layer alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from benchmarks.harness import Chart, Report, Table, quantile
from kvserve.cli import UsageError
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from security.config import TLS_DIR_ENV, SecurityConfig
from security.secret_files import redis_url_args


@dataclass(frozen=True, slots=True)
class FrontBenchConfig:
    model: str = "tiny-dense"
    prompt_tokens: int = 256
    requests: int = 40
    rejects: int = 400
    warmup: int = 3
    seed: int = 0
    ready_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 2 or self.requests < 2 or self.rejects < 2 or self.warmup < 0:
            raise ValueError("prompt_tokens, requests and rejects must be >= 2, warmup >= 0")


@dataclass(frozen=True, slots=True)
class FrontBenchResult:
    model: str
    prompt_tokens: int
    requests: int
    ttft_direct_p50_ms: float
    ttft_direct_p90_ms: float
    ttft_router_p50_ms: float
    ttft_router_p90_ms: float
    overhead_p50_ms: float
    reject_p50_ms: float
    reject_p99_ms: float
    rejects_per_s: float


def _ms(xs: list[float], q: float) -> float:
    return round(quantile(xs, q) * 1e3, 2)


async def _direct(prefill: prefill_pb2_grpc.PrefillStub, decode: decode_pb2_grpc.DecodeStub,
                  tokens: list[int]) -> float:
    sampling = common_pb2.SamplingParams(max_tokens=1)
    t0 = time.perf_counter()
    handle = await prefill.Prefill(prefill_pb2.PrefillRequest(
        ctx=common_pb2.RequestContext(), token_ids=tokens, sampling=sampling), timeout=120)
    call = decode.Decode(decode_pb2.DecodeRequest(handle=handle, sampling=sampling), timeout=120)
    await call.read()
    dt = time.perf_counter() - t0
    call.cancel()
    return dt


async def _router(session: aiohttp.ClientSession, url: str, model: str,
                  tokens: list[int]) -> float:
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "stream": True}
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: "):
                dt = time.perf_counter() - t0
                break
        else:
            raise RuntimeError("the router stream ended without data")
        await resp.read()
    return dt


async def _reject(session: aiohttp.ClientSession, url: str, model: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json={"model": model, "prompt": "x", "temperature": 9}) as r:
        await r.read()
        if r.status != 400:
            raise RuntimeError(f"expected a 400, got {r.status}")
    return time.perf_counter() - t0


async def _measure(cfg: FrontBenchConfig, prefill_addr: str, decode_addr: str, http: str,
                   vocab: int) -> FrontBenchResult:
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    # Low ids are bytes/specials in every tokenizer we serve; stay clear of them.
    lo = min(300, vocab - 2)

    def fresh() -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(cfg.prompt_tokens)]

    direct: list[float] = []
    routed: list[float] = []
    sec = SecurityConfig.from_env("operator")
    async with sec.aio_channel(prefill_addr, "prefill") as pch, \
            sec.aio_channel(decode_addr, "decode") as dch, aiohttp.ClientSession() as session:
        pstub, dstub = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
        url = f"{http}/v1/completions"
        for _ in range(cfg.warmup):
            await _direct(pstub, dstub, fresh())
            await _router(session, url, cfg.model, fresh())
        for i in tqdm(range(cfg.requests), desc="ttft", file=sys.stderr):
            # Alternate which path goes first so drift hits both alike.
            if i % 2:
                direct.append(await _direct(pstub, dstub, fresh()))
                routed.append(await _router(session, url, cfg.model, fresh()))
            else:
                routed.append(await _router(session, url, cfg.model, fresh()))
                direct.append(await _direct(pstub, dstub, fresh()))
        rejects = []
        t0 = time.perf_counter()
        for _ in tqdm(range(cfg.rejects), desc="rejects", file=sys.stderr):
            rejects.append(await _reject(session, url, cfg.model))
        rejects_s = time.perf_counter() - t0
    return FrontBenchResult(
        model=cfg.model, prompt_tokens=cfg.prompt_tokens, requests=cfg.requests,
        ttft_direct_p50_ms=_ms(direct, 0.5), ttft_direct_p90_ms=_ms(direct, 0.9),
        ttft_router_p50_ms=_ms(routed, 0.5), ttft_router_p90_ms=_ms(routed, 0.9),
        overhead_p50_ms=round((quantile(routed, 0.5) - quantile(direct, 0.5)) * 1e3, 2),
        reject_p50_ms=_ms(rejects, 0.5), reject_p99_ms=_ms(rejects, 0.99),
        rejects_per_s=round(cfg.rejects / rejects_s, 1))


def _wait_http(url: str, timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")
        time.sleep(0.2)


def run(cfg: FrontBenchConfig) -> FrontBenchResult:
    from kvserve.children import Child, start_children, stop_children
    from kvstore.redis_server import EmbeddedRedis, free_port
    from router.model_meta import load_model_meta

    vocab = load_model_meta(cfg.model).vocab_size
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-front-") as tmp, \
            EmbeddedRedis() as redis:
        d = Path(tmp)
        # mTLS as deployed; children, health checks and channels find it in the env.
        tls = os.environ[TLS_DIR_ENV] = SecurityConfig.for_local_run(d / "tls").cert_dir
        ports = {n: free_port() for n in ("store", "prefill", "decode", "router", "http")}
        base = [sys.executable, "-m", "kvserve.cli"]
        def common(role: str) -> list[str]:      # each role its own Redis user, by file
            # Children inherit no credential variable (kvserve.credentials): named here.
            return ["--host", "127.0.0.1", "--tls-dir", tls,
                    *redis_url_args(redis.url_for(role), d, f"{role}.redis.url")]

        addr = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
        children = [
            Child("store", [*base, "store", "serve", *common("kvstore"), "--port",
                            str(ports["store"]), "--metrics-port", "-1"], addr["store"],
                  d / "store.log"),
            *[Child(role, [*base, role, "serve", *common(role), "--port", str(ports[role]),
                           "--store", addr["store"], "--model", cfg.model],
                    addr[role], d / f"{role}.log") for role in ("prefill", "decode")],
            Child("router", [*base, "router", "serve", *common("router"), "--port",
                             str(ports["router"]), "--http-port", str(ports["http"]),
                             "--model", cfg.model],
                  addr["router"], d / "router.log"),
        ]
        start_children(children, cfg.ready_timeout_s)
        try:
            http = f"http://{addr['http']}"
            _wait_http(f"{http}/health", 30)
            return asyncio.run(_measure(cfg, addr["prefill"], addr["decode"], http, vocab))
        finally:
            stop_children(children, 10.0)


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench front``: the flags in, the harness's report out."""
    try:
        cfg = FrontBenchConfig(model=args.model, prompt_tokens=args.prompt_tokens,
                               requests=args.requests, rejects=args.rejects)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    r = run(cfg)
    table = Table(("path", "TTFT p50 ms", "TTFT p90 ms"))
    table.add("direct gRPC Prefill+Decode", r.ttft_direct_p50_ms, r.ttft_direct_p90_ms)
    table.add("router HTTP /v1/completions", r.ttft_router_p50_ms, r.ttft_router_p90_ms)
    return Report(f"model {r.model}, {r.prompt_tokens}-token fresh prompts, {r.requests} "
                  "requests per path, interleaved", asdict(r), [table], notes=[
                      f"front overhead (p50 difference): {r.overhead_p50_ms:.2f} ms",
                      f"rejected by validation (400): p50 {r.reject_p50_ms:.2f} ms, p99 "
                      f"{r.reject_p99_ms:.2f} ms, {r.rejects_per_s:.0f} requests/s sequential"],
                  chart=Chart(f"TTFT through the front, {r.model}", ("p50", "p90"),
                              {"direct gRPC": [r.ttft_direct_p50_ms, r.ttft_direct_p90_ms],
                               "router HTTP": [r.ttft_router_p50_ms, r.ttft_router_p90_ms]},
                              ylabel="ms"))
