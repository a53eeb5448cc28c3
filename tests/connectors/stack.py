"""The real parts the vLLM connector tests run against: a kvstore process (on a
fixed free port, so it can be killed and restarted in place), vLLM OpenAI
servers with the connector (kvserve.launch_vllm: HTTPS, API key, own identity),
and small HTTP helpers that call them as kvserve's router does (salts minted
with the deployment secret, ``security.vllm_trust``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from connectors.vllm_presence import stats_key
from kvserve.children import die_with_parent
from kvstore.keys import chain_keys
from kvstore.redis_server import free_port
from tests.redis_args import redis_args

BLOCK = 64


def security() -> tuple[str, bool]:
    """(tls_dir, insecure) for the stack: mTLS when the suite has a deployment
    (KVSERVE_TLS_DIR) and the kvstore client speaks it, else plain text."""
    from connectors.vllm import _client_takes_security

    tls = os.environ.get("KVSERVE_TLS_DIR", "")
    if tls and _client_takes_security():
        return tls, False
    return "", True


def role_security(role: str):  # type: ignore[no-untyped-def]
    """Credentials of ``role`` from the suite's deployment, or plain text where
    the stack runs without it (security.config.SecurityConfig)."""
    from security.config import SecurityConfig

    tls, insecure = security()
    return SecurityConfig(insecure=True) if insecure else SecurityConfig(cert_dir=tls, role=role)


@contextlib.asynccontextmanager
async def vllm_router(redis_url: str) -> AsyncIterator[tuple[Any, str]]:
    """A router (the router role's credentials) over the vLLM servers registered
    in ``redis_url``: (router, its HTTP base URL), stopped after."""
    from router.serve import RouterConfig, start_router

    r = await start_router(RouterConfig(model="smollm2", grpc_port=0, http_port=0,
                                        redis_url=redis_url, backend="vllm",
                                        security=role_security("router")))
    try:
        yield r, f"http://127.0.0.1:{r.http_port}"
    finally:
        await r.stop(1.0)


def operator_security():  # type: ignore[no-untyped-def]
    """The tests' own credentials toward the kvstore."""
    return role_security("operator")


def store_client(address: str):  # type: ignore[no-untyped-def]
    from connectors.vllm import _client_takes_security
    from kvstore.client import KVStoreClient

    kw = {"security": operator_security()} if _client_takes_security() else {}
    return KVStoreClient(address, timeout_s=10, **kw)


def deployment_secret() -> bytes:
    """The secret the connectors key tenant salts with (none in plain text)."""
    return operator_security().require_secret()


def salt(tenant: str, nonce: str = "r") -> str:
    """The cache_salt kvserve's router sends for ``tenant``; another ``nonce`` names
    the same tenant with a cold vLLM-local cache (so only the warehouse can answer)."""
    from security.vllm_trust import tenant_salt

    return tenant_salt(tenant, deployment_secret(), nonce)


@dataclass
class Store:
    port: int
    redis_url: str
    g3: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Store:
        tls, insecure = security()
        argv = [sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--metrics-port", "-1", *redis_args(self.redis_url),
                "--g2-bytes", "256MiB", "--g3-path", str(self.g3), "--no-prefault",
                "--no-fsync", "--grace", "2", *(["--insecure"] if insecure else
                                                ["--tls-dir", tls])]
        start = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if b"kvstore ready" in self.log.read_bytes()[start:]:
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"kvstore did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def new_store(redis_url: str, root: Path) -> Store:
    root.mkdir(parents=True, exist_ok=True)
    return Store(free_port(), redis_url, root / "g3", root / "kvstore.log")


# ----------------------------------------------------------------- HTTP


def _caller(server: Any) -> tuple[str, Any, dict[str, str]]:
    """(base URL, TLS context, headers) to call a VLLMProcess as the router does."""
    from kvserve.launch_vllm import client_ssl

    spec = server.spec
    headers = {"content-type": "application/json"}
    if not spec.insecure:
        headers["authorization"] = f"Bearer {spec.api_key()}"
    return spec.base_url, client_ssl(spec), headers


def post(server: Any, path: str, body: dict[str, Any] | None = None,
         timeout_s: float = 300.0) -> dict[str, Any]:
    base, ctx, headers = _caller(server)
    req = urllib.request.Request(base + path, data=json.dumps(body or {}).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
        return json.loads(resp.read() or b"{}")


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    cached_tokens: int


def complete(server: Any, prompt: list[int], *, salt: str | None, max_tokens: int = 32,
                kv_class: str = "") -> Completion:
    """Greedy completion of token ids on a vLLM server, with ``salt`` as cache_salt
    (None: no salt at all)."""
    body: dict[str, Any] = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    if kv_class:
        body["kv_transfer_params"] = {"kv_class": kv_class}
    out = post(server, "/v1/completions", body)
    choice, usage = out["choices"][0], out["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Completion(tuple(choice["token_ids"]), choice["text"], usage["prompt_tokens"],
                      int(details.get("cached_tokens") or 0))


def hit_rule(prompt_tokens: int, stored_blocks: int, reserve: int = 1) -> int:
    limit = min(stored_blocks * BLOCK, prompt_tokens - reserve)
    return max(0, limit - limit % BLOCK)


def stats(redis_url: str, instance_id: str) -> dict[str, int]:
    r = redis.Redis.from_url(redis_url)
    try:
        return {k.decode(): int(v) for k, v in r.hgetall(stats_key(instance_id)).items()}
    finally:
        r.close()


def wait_count(redis_url: str, instance: str, before: dict[str, int], name: str,
               delta: int, timeout_s: float = 30.0) -> dict[str, int]:
    """The counters once ``name`` grew by ``delta`` since ``before`` (the connector's
    processes flush their counters every few hundred ms)."""
    wait_for(lambda: stats(redis_url, instance).get(name, 0) - before.get(name, 0) >= delta,
             timeout_s, what=f"{instance} {name} +{delta}")
    return stats(redis_url, instance)


def wait_for(cond: Any, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def prompts(n: int, *, seed: int, lo: int = 130, hi: int = 700,
            vocab: int = 49152) -> list[list[int]]:
    """``n`` distinct token-id prompts of varied lengths (not all block-aligned)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def fingerprint(redis_url: str) -> bytes:
    """The model fingerprint the stack's vLLM servers registered (all the same)."""
    import asyncio

    from kvstore.registry import InstanceRegistry

    async def get() -> str:
        async with InstanceRegistry(redis_url) as reg:
            return next(i.model_fingerprint for i in await reg.list_instances()
                        if i.role in ("prefill", "decode") and i.model_fingerprint)

    return bytes.fromhex(asyncio.run(get()))


def block_keys(redis_url: str, tokens: list[int], cache_salt: str) -> list[bytes]:
    """The keys a connector computes for ``tokens`` under ``cache_salt``."""
    from connectors.vllm_identity import identity_of
    from kvstore.keys import chain_keys

    ident = identity_of(cache_salt, fingerprint(redis_url), deployment_secret())
    return chain_keys(tokens, block_tokens=BLOCK, tenant=ident.tenant,
                      fingerprint=ident.fingerprint, secret=deployment_secret())


def wait_stored(stack: Any, want: list[tuple[list[int], str, int]],
                timeout_s: float = 120.0) -> None:
    """Until the warehouse holds ``blocks`` leading blocks of each (tokens, salt).

    One client polls, as a real one would hold its channel (one TLS handshake,
    not one every 100 ms). A store unavailable for a moment is "not yet"; a
    store that stays away times out with the waited-for condition named. (The
    failed handshake that once failed this wait was the channels' 100 ms
    connection-attempt deadline: tests/security/test_channels.py.)"""
    from connectors.vllm_identity import identity_of
    from kvstore.errors import StoreUnavailable
    from kvstore.types import RequestCtx

    fp = fingerprint(stack.redis_url)
    looks = []
    for tokens, cache_salt, blocks in want:
        ident = identity_of(cache_salt, fp, deployment_secret())
        looks.append((block_keys(stack.redis_url, tokens, cache_salt), len(tokens) + BLOCK,
                      RequestCtx(request_id="test", tenant=ident.tenant,
                                 model_fingerprint=ident.fingerprint.hex()), blocks))

    async def held(c: Any) -> bool:
        for keys, prompt_tokens, ctx, blocks in looks:
            res = await c.lookup(keys, prompt_tokens=prompt_tokens, ctx=ctx, touch=False)
            if int(res.matched_blocks) < blocks:
                return False
        return True

    async def wait() -> None:
        deadline = time.monotonic() + timeout_s
        async with store_client(stack.store.address) as c:
            while time.monotonic() < deadline:
                with contextlib.suppress(StoreUnavailable):
                    if await held(c):
                        return
                await asyncio.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s}s waiting for the connector's saves")

    asyncio.run(wait())


def router_keys(r: Any, messages: list[dict[str, str]]) -> list[bytes]:
    """The block keys our router (``router.serve`` handle ``r``) gives a chat prompt."""
    tokens = r.core.meta.tokenizer.apply_chat_template(messages)
    return chain_keys(tokens, block_tokens=BLOCK, tenant="default",
                      fingerprint=bytes.fromhex(r.view.fingerprint()), secret=r.core.cfg.secret)


async def until_router_places(r: Any, keys: list[bytes], where: str,
                              timeout_s: float) -> None:
    """Wait until the router's prefix view shows ``keys`` held by ``where``."""
    for _ in range(int(timeout_s / 0.05)):
        if where in r.view.prefixes.match(keys):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the router never learned where the prefix is")
