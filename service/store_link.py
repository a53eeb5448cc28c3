"""The warehouse as an engine service sees it: a ``KVStoreClient`` whose
read failures degrade to "no hit" instead of failing the request.

When the store is unreachable, ``lookup`` and ``get`` return None and count
the degradation; the request recomputes. The gRPC channel reconnects by
itself (short reconnect backoff), so hits come back as soon as the store
does. ``put`` raises, because the block writer retries it. Without a store
address every call is a counted no-op ("no warehouse").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from kvstore.errors import ResourceExhausted
from kvstore.types import GetResult, LookupResult, PutResult, RequestCtx
from security.config import SecurityConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreStats:
    lookups_total: int = 0
    gets_total: int = 0
    puts_total: int = 0
    degraded_total: dict[str, int] = field(default_factory=dict)   # op -> failures
    available: int = 1              # 1 while the last call succeeded


class StoreLink:
    def __init__(self, address: str, *, timeout_s: float, use_shm: bool = True,
                 security: SecurityConfig | None = None) -> None:
        self.address = address
        self._security = security
        self._timeout_s = timeout_s
        self._use_shm = use_shm
        self._client: object | None = None
        self._tiers: list[str] = []
        self.stats = StoreStats(available=1 if address else 0)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def _c(self) -> object:
        if self._client is None:
            from kvstore.client import KVStoreClient

            self._client = KVStoreClient(self.address, timeout_s=self._timeout_s,
                                         use_shm=self._use_shm, security=self._security)
        return self._client

    async def _degraded(self, op: str, exc: BaseException) -> None:
        self.stats.degraded_total[op] = self.stats.degraded_total.get(op, 0) + 1
        if isinstance(exc, ResourceExhausted):
            return      # the store is busy, not gone: this call recomputes, the channel stays
        if self.stats.available:
            log.warning("warehouse %s unavailable (%s: %s); recomputing until it returns",
                        self.address, op, exc)
        self.stats.available = 0
        await self._reset()

    async def _reset(self) -> None:
        # A fresh channel next time: it dials at once instead of waiting out the
        # old channel's reconnect backoff, so hits return as soon as the store does.
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()  # type: ignore[attr-defined]

    def _ok(self) -> None:
        if not self.stats.available:
            log.warning("warehouse %s is back", self.address)
        self.stats.available = 1

    async def lookup(self, keys: Sequence[bytes], *, prompt_tokens: int,
                     ctx: RequestCtx, touch: bool = True) -> LookupResult | None:
        if not self.enabled or not keys:
            return None
        self.stats.lookups_total += 1
        try:
            res = await self._c().lookup(list(keys), prompt_tokens=prompt_tokens,  # type: ignore[attr-defined]
                                         ctx=ctx, touch=touch)
        except _STORE_DOWN as exc:
            await self._degraded("lookup", exc)
            return None
        self._ok()
        return res

    async def get(self, keys: Sequence[bytes], *, ctx: RequestCtx,
                  out: torch.Tensor | None = None) -> GetResult | None:
        """Blocks in key order; with ``out`` ([n, *block_shape], host) the
        payloads land in it directly (no second copy)."""
        if not self.enabled or not keys:
            return None
        self.stats.gets_total += 1
        try:
            res = await self._c().get(list(keys), ctx=ctx, out=out)  # type: ignore[attr-defined]
        except _STORE_DOWN as exc:
            await self._degraded("get", exc)
            return None
        self._ok()
        return res

    async def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, layout: str,
                  token_count: int, ctx: RequestCtx) -> PutResult:
        if not self.enabled:
            return PutResult(0, len(keys), 0)
        self.stats.puts_total += 1
        try:
            res = await self._c().put(list(keys), blocks, layout=layout,  # type: ignore[attr-defined]
                                      token_count=token_count, ctx=ctx)
        except _STORE_DOWN as exc:
            await self._degraded("put", exc)
            raise
        self._ok()
        return res

    async def tier_names(self) -> list[str]:
        """The store's tiers ("G2", "G3", ...), or [] when it does not answer.
        Asked once successfully, then remembered; a store that is not up yet
        (services start in parallel) is asked again on the next call."""
        if not self.enabled:
            return []
        if self._tiers:
            return self._tiers
        try:
            stats = await self._c().stats()  # type: ignore[attr-defined]
        except _STORE_DOWN:
            # Drop the channel: one that failed its first dial sits in reconnect
            # backoff and would fail the first real lookup fast.
            await self._reset()
            return []
        self._tiers = [t.tier for t in stats.tiers]
        return self._tiers

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()  # type: ignore[attr-defined]
            self._client = None


def _store_down_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [grpc.RpcError, OSError, asyncio.TimeoutError]
    try:
        from kvstore.errors import KVStoreError
    except ImportError:
        pass
    else:
        errors.append(KVStoreError)
    return tuple(errors)


_STORE_DOWN = _store_down_errors()
