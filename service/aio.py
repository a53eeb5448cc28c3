"""asyncio helpers that leave no outcome unread.

``asyncio.shield`` stops reading its inner future once the awaiting caller
is cancelled (Python 3.11 removes the inner callback): if the shielded work
later fails, the loop logs "Future exception was never retrieved" (or "Task
exception ...") when it is collected. Under load, with callers hanging up
and deadlines firing, a service's log filled with them. ``shielded`` reads
the outcome itself when its caller has gone; ``settle`` resolves a future
only if nobody resolved or cancelled it yet; ``background`` keeps a task
referenced until done and logs its failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Done callback: mark a finished future's outcome as read (logged at debug)."""
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.debug("outcome nobody awaited any more: %r", exc)


async def shielded(aw: Awaitable[T]) -> T:
    """Await ``aw`` so that cancelling the caller does not cancel it; when the
    caller is cancelled, the outcome of ``aw`` is still read when it comes."""
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(retrieve)
        raise


def settle(fut: asyncio.Future[T], result: T | None = None,
           exc: BaseException | None = None) -> None:
    """Resolve ``fut`` unless it is already done (e.g. cancelled by a caller that
    left). An exception set on a future nobody awaits any more is read at once."""
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)  # type: ignore[arg-type]
        return
    fut.set_exception(exc)


def background(coro: Coroutine[Any, Any, Any], tasks: set[asyncio.Task[Any]],
               name: str) -> asyncio.Task[Any]:
    """Run ``coro`` as a task held in ``tasks`` until it ends; a failure is logged."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("background task %s failed: %r", task.get_name(), exc)
