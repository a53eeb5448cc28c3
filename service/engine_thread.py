"""The engine's own thread: every engine call of a service goes through it.

The engine is not thread-safe and its calls are long (torch), so a service
runs them one at a time on a single worker thread, in submission order, and
the event loop stays free for gRPC. Because the order is FIFO, a cleanup
submitted after a call (``free`` after ``adopt``) always runs after it, even
when the awaiting request was cancelled in between.

A long job can still stop early: ``call_stoppable`` hands the job a ``Stop``
that turns true when the awaiting caller is cancelled (its client went away),
and the job polls it between its steps (prefill: before every chunk), so an
abandoned request costs at most the chunk in flight, and a job still waiting
in the queue costs nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Concatenate, ParamSpec, TypeVar

from service.aio import shielded

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


class Stop:
    """Polled by a job between its steps; true once its caller has gone."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def __call__(self) -> bool:
        return self._event.is_set()


class EngineThread:
    def __init__(self, name: str = "engine") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Written by one thread each (submit: the loop; done: the worker), so no lock.
        self._submitted = 0
        self._completed = 0
        self.busy_s = 0.0            # time spent running jobs
        self.stopped_total = 0       # stoppable jobs whose caller went away
        self._mark = (time.monotonic(), 0.0)

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished (the running one included)."""
        return self._submitted - self._completed

    def utilization(self) -> float:
        """Busy fraction since the previous call: the load an instance reports."""
        now, busy = time.monotonic(), self.busy_s
        (t0, b0), self._mark = self._mark, (now, busy)
        return min(1.0, (busy - b0) / (now - t0)) if now > t0 else 0.0

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` on the engine thread. If the caller is cancelled the job
        still completes (the engine's state stays consistent) and its outcome
        is read then (service/aio.py: never an unretrieved exception)."""
        fut = self.submit(fn, *args, **kwargs)
        return await shielded(asyncio.wrap_future(fut))

    async def call_stoppable(self, fn: Callable[Concatenate[Stop, P], T], *args: P.args,
                             **kwargs: P.kwargs) -> T:
        """Like ``call``, but ``fn(stop, ...)`` is told when the caller is cancelled,
        so it can end at its next step instead of running to the end for nobody."""
        stop = Stop()
        fut = self.submit(fn, stop, *args, **kwargs)
        try:
            return await shielded(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            stop.set()
            self.stopped_total += 1
            raise

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue ``fn`` without waiting; errors are logged when nobody awaits them."""
        self._submitted += 1
        job = functools.partial(self._timed, fn, *args, **kwargs)
        fut = self._pool.submit(job)
        fut.add_done_callback(self._log_unawaited)
        return fut

    def _timed(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0
            self._completed += 1

    @staticmethod
    def _log_unawaited(fut: Future[object]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("engine job failed: %r", fut.exception())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
