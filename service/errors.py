"""Service errors and their gRPC status codes, in one place.

Both services (prefill and decode) raise the exceptions below, or let the
engine's and config's input errors through; ``grpc_unary`` / ``grpc_stream``
turn whatever escapes a handler into one status code with a message that
names the problem. Nothing else in the services calls ``context.abort``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import grpc

from security.redact import redact

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """Base of the errors a service raises on purpose."""


class InvalidRequest(ServiceError, ValueError):
    """The request itself is malformed (empty prompt, max_tokens <= 0, ...)."""


class PreconditionFailed(ServiceError):
    """The request is well formed but cannot be served here (wrong model,
    expired handle, unknown request id)."""


class HandleExpired(PreconditionFailed):
    """A KV handle's host buffer is gone (expired or released)."""


class Overloaded(ServiceError):
    """No room right now (a full queue): raised *before* any work is done, so
    the caller may take the request elsewhere. ``retry_after_s`` is this
    instance's estimate of when it has room; it goes out as the trailing
    metadata ``retry-after-ms`` (the busy-instance contract the router reads)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, retry_after_s)


class Busy(Overloaded):
    """A bounded queue is full: ``Overloaded`` with the estimate in milliseconds,
    as the schedulers compute it."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message, retry_after_s=max(1, int(retry_after_ms)) / 1000)
        self.retry_after_ms = max(1, int(retry_after_ms))


class UpstreamUnavailable(ServiceError):
    """A service this one depends on did not answer."""


RETRY_AFTER_KEY = "retry-after-ms"       # trailing metadata of RESOURCE_EXHAUSTED


class Status(NamedTuple):
    code: grpc.StatusCode
    message: str
    retry_after_ms: int | None = None    # busy: when to try this instance again


# Most specific class first: the first isinstance match wins.
_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UpstreamUnavailable, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


# Upstream codes that mean the same for our caller; anything else: UNAVAILABLE.
_PASS_THROUGH = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.RESOURCE_EXHAUSTED})


def register_status(exc_type: type[BaseException], code: grpc.StatusCode) -> None:
    """Map another package's exception (e.g. the engine's input error) to a code."""
    _CODES.insert(0, (exc_type, code))


def _register_known() -> None:
    from common.config import ConfigError

    register_status(ConfigError, grpc.StatusCode.INVALID_ARGUMENT)
    try:
        from kvstore.errors import InvalidRequest as StoreInvalidRequest
        from kvstore.errors import StoreUnavailable
    except ImportError:
        pass
    else:
        from kvstore.keys import KeyInputError

        register_status(StoreUnavailable, grpc.StatusCode.UNAVAILABLE)
        register_status(StoreInvalidRequest, grpc.StatusCode.INVALID_ARGUMENT)
        register_status(KeyInputError, grpc.StatusCode.INVALID_ARGUMENT)
    try:
        from engine.errors import EngineInputError
    except ImportError:  # the engine package is optional for the router's use of this module
        return
    register_status(EngineInputError, grpc.StatusCode.INVALID_ARGUMENT)


_register_known()


def status_for(exc: BaseException) -> Status:
    if isinstance(exc, grpc.aio.AioRpcError):
        # An upstream call failed: say which status it gave and why.
        code = exc.code()
        mapped = code if code in _PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
        return Status(mapped, f"upstream call failed: {code.name}: {exc.details()}")
    if isinstance(exc, Overloaded):
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "overloaded",
                      max(1, round(exc.retry_after_s * 1000)))
    for exc_type, code in _CODES:
        if isinstance(exc, exc_type):
            return Status(code, str(exc) or exc_type.__name__)
    return Status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, where: str) -> None:
    status = status_for(exc)
    # Status text reaches the caller: never a secret in it (security.redact).
    status = Status(status.code, redact(status.message))
    if status.code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", where, exc_info=exc)
    else:
        log.info("%s -> %s: %s", where, status.code.name, status.message)
    if status.retry_after_ms is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(status.retry_after_ms)),))
    await context.abort(status.code, status.message)


Req = TypeVar("Req")
Resp = TypeVar("Resp")
UnaryHandler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
StreamHandler = Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]


def grpc_unary(fn: UnaryHandler[Req, Resp]) -> UnaryHandler[Req, Resp]:
    """Wrap a unary handler so that every escaping exception becomes a status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # mapped to a status right here
            await _abort(context, exc, fn.__qualname__)
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper


def grpc_stream(fn: StreamHandler[Req, Resp]) -> StreamHandler[Req, Resp]:
    """Wrap a server-streaming handler the same way."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # mapped to a status right here
            await _abort(context, exc, fn.__qualname__)

    return wrapper
