"""``StoreBridge``: blocking calls into kvserve's async ``KVStoreClient`` for
vLLM's synchronous connector hooks.

The client runs on one event loop in a daemon thread owned by the bridge
(vLLM's scheduler and workers call the connector from plain threads, and the
gRPC aio channel must stay on one loop). ``call`` waits for a result with a
deadline; ``submit`` returns a future, for work kept off the critical path.

Degradation: a call that fails because the store cannot be reached opens a
breaker for ``retry_after_s``; meanwhile calls fail at once with
``StoreUnavailable`` instead of each waiting out a timeout, so vLLM keeps
serving at recompute speed and hits return once the store answers again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvstore.client import KVStoreClient
from kvstore.errors import StoreUnavailable

T = TypeVar("T")


class StoreBridge:
    def __init__(self, address: str, *, use_shm: bool, retry_after_s: float,
                 security: Any = None, timeout_s: float = 10.0,
                 on_degraded: Callable[[str], None] | None = None) -> None:
        self.address = address
        self.retry_after_s = retry_after_s
        self._on_degraded = on_degraded or (lambda why: None)
        self._open_until = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvserve-bridge",
                                        daemon=True)
        self._thread.start()
        self._stale = False
        self._closing: set[asyncio.Task[None]] = set()
        self._args = (address, use_shm, timeout_s, security)
        self.client: KVStoreClient = self._run(self._make(*self._args), 10.0)

    @staticmethod
    async def _make(address: str, use_shm: bool, timeout_s: float,
                    security: Any) -> KVStoreClient:
        kw: dict[str, Any] = {"timeout_s": timeout_s, "use_shm": use_shm}
        if security is not None:
            kw["security"] = security          # mTLS (issue 10's authenticated client)
        return KVStoreClient(address, **kw)

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def degraded(self) -> bool:
        return time.monotonic() < self._open_until

    def call(self, make: Callable[[KVStoreClient], Coroutine[Any, Any, T]],
             timeout_s: float) -> T:
        """Run ``make(client)`` on the bridge loop and wait; StoreUnavailable while the
        breaker is open or when the store does not answer in time."""
        return self.submit(make, timeout_s).result(timeout_s + 1.0)

    def submit(self, make: Callable[[KVStoreClient], Coroutine[Any, Any, T]],
               timeout_s: float) -> concurrent.futures.Future[T]:
        if self.degraded:
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            fut.set_exception(StoreUnavailable(f"kvstore {self.address} is in back-off"))
            return fut
        return asyncio.run_coroutine_threadsafe(self._guarded(make, timeout_s), self._loop)

    async def _guarded(self, make: Callable[[KVStoreClient], Coroutine[Any, Any, T]],
                       timeout_s: float) -> T:
        if self._stale:
            await self._reconnect()
        try:
            return await asyncio.wait_for(make(self.client), timeout_s)
        except (StoreUnavailable, TimeoutError) as exc:
            self._open_until = time.monotonic() + self.retry_after_s
            self._stale = True
            self._on_degraded(type(exc).__name__)
            raise StoreUnavailable(f"kvstore {self.address}: {exc}") from exc

    async def _reconnect(self) -> None:
        """A fresh channel after a failure: gRPC's own reconnect back-off grows while
        the store is down (to minutes), which would keep a restarted store unused."""
        self._stale = False
        old, self.client = self.client, await self._make(*self._args)

        async def close_later() -> None:     # calls still running on it may finish
            await asyncio.sleep(30.0)
            with contextlib.suppress(Exception):
                await old.close()

        self._closing.add(task := asyncio.get_running_loop().create_task(close_later()))
        task.add_done_callback(self._closing.discard)

    def close(self) -> None:
        if not self._loop.is_running():
            return
        # Closing a channel to a dead store must not block shutdown.
        with contextlib.suppress(Exception):
            self._run(self.client.close(), 5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
