"""Router errors and the one place they become HTTP or gRPC statuses.

Every failure a client can see is a ``RouterError`` subclass carrying its
OpenAI error ``type``/``code``/``param``; ``http_error`` and ``grpc_status``
turn any exception into the status and body each front answers with, so no
handler picks a status code by itself. Failures of the prefill/decode
instances arrive as gRPC errors and are wrapped by ``upstream_error``, which
also decides whether trying another instance can help.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc

from security.redact import redact


class RouterError(Exception):
    """Base of every error the router reports to a client."""

    http_status = 500
    error_type = "server_error"
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(RouterError, ValueError):
    """The request is malformed or asks for something we cannot do."""

    http_status = 400
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class ContextLengthError(InvalidRequestError):
    """Prompt plus max_tokens do not fit the model's context."""

    def __init__(self, message: str, *, param: str | None = "max_tokens") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class AuthenticationError(RouterError):
    http_status = 401
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class PermissionDeniedError(RouterError):
    """Authenticated, but asking to act for a tenant it is not (router.service.tenant_of)."""

    http_status = 403
    error_type = "permission_error"
    grpc_code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, message: str) -> None:
        super().__init__(message, code="permission_denied")


class ModelNotFoundError(RouterError):
    http_status = 404
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model {model!r} does not exist; this router serves {served!r}",
                         param="model", code="model_not_found")


class RouteNotFoundError(RouterError):
    http_status = 404
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class MethodNotAllowedError(RouterError):
    http_status = 405
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class PayloadTooLargeError(InvalidRequestError):
    http_status = 413


class UnsupportedMediaTypeError(InvalidRequestError):
    """A Content-Type or Content-Encoding the front does not decode."""

    http_status = 415


class HeaderError(InvalidRequestError):
    """The HTTP request itself is malformed (aiohttp's parser refused it)."""


class HeaderTooLargeError(HeaderError):
    http_status = 431


class NoInstanceError(RouterError):
    """No live instance of a role is available (none registered, or all failed)."""

    http_status = 503
    error_type = "service_unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class RateLimitedError(RouterError):
    """Backpressure, decided before any work: the caller should retry after
    ``retry_after_s`` (HTTP 429 + Retry-After; gRPC RESOURCE_EXHAUSTED +
    ``retry-after-ms``). ``reason`` names the limit (router.admission)."""

    http_status = 429
    error_type = "rate_limit_error"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, reason: str, retry_after_s: int) -> None:
        super().__init__(f"{message}; retry after {retry_after_s}s", code=reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class DeadlineError(RouterError):
    """The request's end-to-end budget ran out."""

    http_status = 504
    error_type = "server_error"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout")


class UpstreamError(RouterError):
    """A prefill/decode instance failed; ``retryable`` says another may succeed."""

    http_status = 502
    error_type = "server_error"
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, retryable: bool, instance: str = "",
                 http_status: int = 502,
                 grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 relayed: bool = False, busy_s: float | None = None) -> None:
        super().__init__(message, code="upstream_error")
        self.retryable = retryable
        self.instance = instance
        # The instance refused before doing any work (RESOURCE_EXHAUSTED; docs/services.md,
        # "Busy"): busy, not broken; try again after busy_s (its retry-after-ms).
        self.busy_s = busy_s
        # The instance answered, but with the failure of a call it made itself
        # (decode's PullKV from prefill): the instance it called is to blame.
        self.relayed = relayed
        self.http_status = http_status
        self.grpc_code = grpc_code


@dataclass(frozen=True, slots=True)
class _UpstreamRule:
    retryable: bool
    http_status: int
    grpc_code: grpc.StatusCode
    client_fault: bool = False


# How a status from an instance is handled: UNAVAILABLE/DEADLINE/RESOURCE_EXHAUSTED/
# FAILED_PRECONDITION are about that instance or the cluster, so another try may do;
# INVALID_ARGUMENT/OUT_OF_RANGE are about the request and would fail anywhere, so
# they go back to the client as 400.
_UPSTREAM: dict[grpc.StatusCode, _UpstreamRule] = {
    grpc.StatusCode.UNAVAILABLE: _UpstreamRule(True, 503, grpc.StatusCode.UNAVAILABLE),
    grpc.StatusCode.DEADLINE_EXCEEDED: _UpstreamRule(True, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    grpc.StatusCode.RESOURCE_EXHAUSTED: _UpstreamRule(True, 429,
                                                      grpc.StatusCode.RESOURCE_EXHAUSTED),
    grpc.StatusCode.ABORTED: _UpstreamRule(True, 503, grpc.StatusCode.ABORTED),
    grpc.StatusCode.CANCELLED: _UpstreamRule(True, 503, grpc.StatusCode.UNAVAILABLE),
    grpc.StatusCode.NOT_FOUND: _UpstreamRule(True, 502, grpc.StatusCode.UNAVAILABLE),
    grpc.StatusCode.INVALID_ARGUMENT: _UpstreamRule(False, 400, grpc.StatusCode.INVALID_ARGUMENT,
                                                    client_fault=True),
    grpc.StatusCode.OUT_OF_RANGE: _UpstreamRule(False, 400, grpc.StatusCode.OUT_OF_RANGE,
                                                client_fault=True),
    # An expired KV handle or a model/layout mismatch between instances: the
    # cluster's state, not the request, so prefill again elsewhere.
    grpc.StatusCode.FAILED_PRECONDITION: _UpstreamRule(True, 503, grpc.StatusCode.UNAVAILABLE),
}
_UPSTREAM_DEFAULT = _UpstreamRule(False, 502, grpc.StatusCode.INTERNAL)
# How the services word a status they pass on from their own upstream call
# (service.errors.status_for).
RELAYED_PREFIX = "upstream call failed"


RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata of a busy instance (service.errors)
_DEFAULT_BUSY_S = 0.5                # a busy instance that gave no estimate


def busy_seconds(exc: grpc.RpcError) -> float:
    """An instance's retry-after-ms as seconds (bounded: a peer's number, not ours)."""
    trailing = exc.trailing_metadata() if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) \
        else None
    for k, v in trailing or ():
        if k == RETRY_AFTER_KEY:
            try:
                return min(60.0, max(0.001, int(v) / 1000))
            except (TypeError, ValueError):
                break
    return _DEFAULT_BUSY_S


def upstream_error(exc: grpc.RpcError, *, role: str, instance: str) -> RouterError:
    """A gRPC failure of a prefill/decode call as the error the client should see."""
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) else "") or ""
    rule = _UPSTREAM.get(code, _UPSTREAM_DEFAULT) if code is not None else _UPSTREAM_DEFAULT
    if rule.client_fault:
        # The instance judged the request itself bad: pass its message on verbatim.
        return InvalidRequestError(details or f"{role} rejected the request")
    name = code.name if code is not None else type(exc).__name__
    relayed = details.startswith(RELAYED_PREFIX)
    busy = (busy_seconds(exc) if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not relayed
            else None)
    return UpstreamError(f"{role} instance {instance} failed: {name}: {details}",
                         retryable=rule.retryable, instance=instance,
                         http_status=rule.http_status, grpc_code=rule.grpc_code,
                         relayed=relayed, busy_s=busy)


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    body: dict[str, dict[str, str | None]]
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> str:
        return json.dumps(self.body)


def error_body(message: str, *, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(exc: BaseException) -> HttpError:
    """The HTTP status and OpenAI-shaped body for any exception."""
    if isinstance(exc, RouterError):
        return HttpError(exc.http_status, error_body(redact(exc.message),
                                                     error_type=exc.error_type,
                                                     param=exc.param, code=exc.code),
                         retry_headers(exc))
    # Anything else is our bug; say so without leaking internals beyond the type.
    return HttpError(500, error_body(redact(f"internal error: {type(exc).__name__}: {exc}"),
                                     error_type="server_error", code="internal_error"))


def retry_headers(exc: BaseException) -> dict[str, str]:
    """``Retry-After`` (whole seconds) for backpressure; nothing otherwise."""
    if isinstance(exc, RateLimitedError):
        return {"Retry-After": str(exc.retry_after_s)}
    return {}


@dataclass(frozen=True, slots=True)
class GrpcStatus:
    code: grpc.StatusCode
    message: str
    trailing: tuple[tuple[str, str], ...] = ()


def grpc_status(exc: BaseException) -> GrpcStatus:
    """The status the gRPC Router service aborts with for any exception."""
    if isinstance(exc, RateLimitedError):
        return GrpcStatus(exc.grpc_code, exc.message,
                          ((RETRY_AFTER_KEY, str(exc.retry_after_s * 1000)),))
    if isinstance(exc, RouterError):
        message = f"{exc.param}: {exc.message}" if exc.param else exc.message
        return GrpcStatus(exc.grpc_code, redact(message))
    return GrpcStatus(grpc.StatusCode.INTERNAL,
                      redact(f"internal error: {type(exc).__name__}: {exc}"))
