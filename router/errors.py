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
from dataclasses import dataclass

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


class UpstreamError(RouterError):
    """A prefill/decode instance failed; ``retryable`` says another may succeed."""

    http_status = 502
    error_type = "server_error"
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, retryable: bool, instance: str = "",
                 http_status: int = 502,
                 grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 relayed: bool = False) -> None:
        super().__init__(message, code="upstream_error")
        self.retryable = retryable
        self.instance = instance
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


def upstream_error(exc: grpc.RpcError, *, role: str, instance: str) -> RouterError:
    """A gRPC failure of a prefill/decode call as the error the client should see."""
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) else "") or ""
    rule = _UPSTREAM.get(code, _UPSTREAM_DEFAULT) if code is not None else _UPSTREAM_DEFAULT
    if rule.client_fault:
        # The instance judged the request itself bad: pass its message on verbatim.
        return InvalidRequestError(details or f"{role} rejected the request")
    name = code.name if code is not None else type(exc).__name__
    return UpstreamError(f"{role} instance {instance} failed: {name}: {details}",
                         retryable=rule.retryable, instance=instance,
                         http_status=rule.http_status, grpc_code=rule.grpc_code,
                         relayed=details.startswith(RELAYED_PREFIX))


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    body: dict[str, dict[str, str | None]]

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
                                                     param=exc.param, code=exc.code))
    # Anything else is our bug; say so without leaking internals beyond the type.
    return HttpError(500, error_body(redact(f"internal error: {type(exc).__name__}: {exc}"),
                                     error_type="server_error", code="internal_error"))


@dataclass(frozen=True, slots=True)
class GrpcStatus:
    code: grpc.StatusCode
    message: str


def grpc_status(exc: BaseException) -> GrpcStatus:
    """The status the gRPC Router service aborts with for any exception."""
    if isinstance(exc, RouterError):
        message = f"{exc.param}: {exc.message}" if exc.param else exc.message
        return GrpcStatus(exc.grpc_code, redact(message))
    return GrpcStatus(grpc.StatusCode.INTERNAL,
                      redact(f"internal error: {type(exc).__name__}: {exc}"))
