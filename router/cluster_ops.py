"""What the router does to the cluster besides serving requests.

* **Session warm-up** (issue 18): on a request's arrival, before it waits in
  any queue, the kvstore is asked to move the prompt's stored blocks up to G2
  (``KVStore.Warm``, kvstore/warm.py); the prefill's restore then reads memory
  instead of disk. Fire and forget, bounded: at most ``max_in_flight`` warms
  run at once (more are skipped and counted: a warm is an optimisation, never
  a queue), each under a deadline, and every task is awaited by the loop's
  done callback so no exception goes unretrieved.
* **Reset prefix cache** (``POST /reset_prefix_cache``, operators only):
  ``ResetPrefixCache`` on every live prefill and decode instance, so every
  engine forgets its G1 prefix cache (vLLM's endpoint of the same name).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvstore.types import RequestCtx
from proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.live_view import ENGINE_ROLES, LiveView
from router.metrics import RouterMetrics
from security.config import SecurityConfig

log = logging.getLogger(__name__)

# HTTP operator key = HMAC(deployment secret, this label): whoever holds the
# deployment's secret (the operator's deployment directory) can compute it; a
# tenant's API key never can. Purpose-bound, so the secret itself never travels.
OPERATOR_KEY_LABEL = b"kvserve/http-operator/v1"


def operator_key(secret: bytes) -> str:
    """The bearer key the HTTP front accepts on operator endpoints ("" without a secret)."""
    if not secret:
        return ""
    return hmac.new(secret, OPERATOR_KEY_LABEL, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class OpsConfig:
    warm: bool = True
    warm_timeout_s: float = 5.0
    max_in_flight: int = 8
    reset_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.warm_timeout_s <= 0 or self.reset_timeout_s <= 0 or self.max_in_flight < 1:
            raise ValueError("OpsConfig: timeouts must be > 0 and max_in_flight >= 1")


@dataclass(frozen=True, slots=True)
class ResetResult:
    instances: dict[str, int]       # instance id -> cached blocks dropped
    failed: dict[str, str]          # instance id -> why


@dataclass(slots=True)
class ClusterOps:
    view: LiveView
    metrics: RouterMetrics
    security: SecurityConfig
    cfg: OpsConfig = field(default_factory=OpsConfig)
    _stores: dict[str, object] = field(default_factory=dict)   # address -> KVStoreClient
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # -- warm-up --------------------------------------------------------------------

    def warm(self, keys: Sequence[bytes], prompt_tokens: int, ctx: RequestCtx,
             session: str = "") -> None:
        """Start moving ``keys``' blocks up to G2; returns at once."""
        if not self.cfg.warm or not keys:
            return
        if len(self._tasks) >= self.cfg.max_in_flight:
            self.metrics.warmups.labels(outcome="skipped").inc()
            return
        address = self.view.store_address(ctx.tenant, session)
        if not address:
            return
        task = asyncio.get_running_loop().create_task(
            self._warm(address, list(keys), prompt_tokens, ctx), name="warm")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, address: str, keys: list[bytes], prompt_tokens: int,
                    ctx: RequestCtx) -> None:
        from kvstore.client import KVStoreClient
        from kvstore.errors import KVStoreError

        client = self._stores.get(address)
        if client is None:
            client = KVStoreClient(address, timeout_s=self.cfg.warm_timeout_s, use_shm=False,
                                   security=self.security)
            self._stores[address] = client
        try:
            res = await client.warm(keys, prompt_tokens=prompt_tokens, ctx=ctx)  # type: ignore[attr-defined]
        except (KVStoreError, grpc.RpcError, OSError) as exc:
            self.metrics.warmups.labels(outcome="failed").inc()
            log.debug("warm-up of %s failed: %s", ctx.request_id, exc)
            return
        except Exception:  # a bug must not vanish with the task
            log.exception("warm-up of %s raised", ctx.request_id)
            self.metrics.warmups.labels(outcome="failed").inc()
            return
        self.metrics.warmups.labels(outcome="done").inc()
        self.metrics.warmed_blocks.inc(res.promoted_blocks)

    # -- reset ------------------------------------------------------------------------

    async def reset_prefix_cache(self) -> ResetResult:
        """``ResetPrefixCache`` on every live engine instance, concurrently."""
        infos = [i for role in ENGINE_ROLES
                 for i in self.view.cluster.candidates(role, exclude=set()).infos]

        async def one(address: str, role: str) -> int:
            async with self.security.aio_channel(address, role) as ch:
                stub = (prefill_pb2_grpc.PrefillStub(ch) if role == "prefill"
                        else decode_pb2_grpc.DecodeStub(ch))
                res = await stub.ResetPrefixCache(common_pb2.ResetPrefixCacheRequest(),
                                                  timeout=self.cfg.reset_timeout_s)
                return int(res.dropped_blocks)

        outcomes = await asyncio.gather(*(one(i.address, i.role) for i in infos),
                                        return_exceptions=True)
        done: dict[str, int] = {}
        failed: dict[str, str] = {}
        for info, out in zip(infos, outcomes, strict=True):
            if isinstance(out, BaseException):
                failed[info.instance_id] = (out.details() if isinstance(out, grpc.aio.AioRpcError)
                                            else type(out).__name__) or "failed"
            else:
                done[info.instance_id] = out
        return ResetResult(done, failed)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._stores.values():
            await client.close()  # type: ignore[attr-defined]
        self._stores.clear()
