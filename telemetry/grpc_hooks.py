"""W3C trace context over gRPC metadata: a server interceptor that opens the
span of an incoming call that carries a ``traceparent``, and client
interceptors that open a CLIENT span for each outgoing call made inside a
trace and send its ``traceparent``.

Both lists are empty while tracing is off (``telemetry.tracing``), so a
server or channel built then has no interceptor at all: no per-call cost.
Install with ``grpc.aio.server(interceptors=[*server_interceptors(), ...])``
(first, so refused calls are traced too) and
``grpc.aio.*_channel(..., interceptors=client_interceptors())``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from telemetry import tracing


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [TraceServerInterceptor()] if tracing.enabled() else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    if not tracing.enabled():
        return []
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


# -- server ------------------------------------------------------------------------------------
def _carrier(metadata: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in metadata or ():
        if key in (tracing.TRACEPARENT, tracing.TRACESTATE):
            out[key] = value if isinstance(value, str) else value.decode("ascii", "replace")
    return out


def _code_name(context: Any) -> str:
    try:
        code = context.code()
    except Exception:  # not every servicer context knows its code yet
        return ""
    if code is None:
        return ""
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


class TraceServerInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        carrier = _carrier(details.invocation_metadata)
        if handler is None or not carrier:
            return handler
        return _wrap(handler, details.method, carrier)


def _wrap(handler: grpc.RpcMethodHandler, method: str,
          carrier: dict[str, str]) -> grpc.RpcMethodHandler:
    name = method.lstrip("/")
    attrs = {"rpc.system": "grpc", "rpc.method": name}

    def opened() -> tracing.Entered | None:
        return tracing.enter(name, carrier, root=False, **attrs)

    def close(entered: tracing.Entered | None, context: Any, exc: BaseException | None) -> None:
        if entered is None:
            return
        code = _code_name(context)
        if code:
            entered.set(**{"rpc.grpc.status_code": code})
        failed = exc is not None and not isinstance(exc, GeneratorExit)
        entered.leave(code if code and code != "OK" else
                      (type(exc).__name__ if failed else ""))

    def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: Any) -> Any:
            entered = opened()
            err: BaseException | None = None
            try:
                res = behavior(request, context)
                return await res if inspect.isawaitable(res) else res
            except BaseException as exc:
                err = exc
                raise
            finally:
                close(entered, context, err)
        return call

    def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            return unary_response(behavior)     # writes through context.write()

        async def gen(request: Any, context: Any) -> AsyncIterator[Any]:
            entered = opened()
            err: BaseException | None = None
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as exc:
                err = exc
                raise
            finally:
                close(entered, context, err)
        return gen

    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler, unary_response),
             ("unary_stream", grpc.unary_stream_rpc_method_handler, stream_response),
             ("stream_unary", grpc.stream_unary_rpc_method_handler, unary_response),
             ("stream_stream", grpc.stream_stream_rpc_method_handler, stream_response))
    for attr, make, wrap in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


# -- client ------------------------------------------------------------------------------------
def _begin(details: grpc.aio.ClientCallDetails) -> tuple[Any, grpc.aio.ClientCallDetails]:
    method = details.method
    name = (method.decode() if isinstance(method, bytes) else str(method)).lstrip("/")
    span = tracing.start_client(name, **{"rpc.system": "grpc", "rpc.method": name})
    if span is None:
        return None, details
    md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
    md[tracing.TRACEPARENT] = tracing.traceparent(span)
    return span, details._replace(metadata=md)


_ENDING: set[asyncio.Task[None]] = set()      # span-ending tasks, referenced until done


def _end_when_done(span: Any, call: Any) -> Any:
    if span is None:
        return call

    def done(c: Any) -> None:
        # An aio call's code is a coroutine: read it (already known) on the loop.
        task = asyncio.get_running_loop().create_task(_finish(span, c))
        _ENDING.add(task)
        task.add_done_callback(_ENDING.discard)

    call.add_done_callback(done)
    return call


async def _finish(span: Any, call: Any) -> None:
    try:
        code = await call.code()
    except Exception:  # a call that never started
        code = None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    span.set_attribute("rpc.grpc.status_code", name)
    if name != "OK":
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, name))
    span.end()


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        span, details = _begin(client_call_details)
        return _end_when_done(span, await continuation(details, request))


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        span, details = _begin(client_call_details)
        return _end_when_done(span, await continuation(details, request))


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        span, details = _begin(client_call_details)
        return _end_when_done(span, await continuation(details, request_iterator))


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        span, details = _begin(client_call_details)
        return _end_when_done(span, await continuation(details, request_iterator))
