"""Unparsable request bytes become INVALID_ARGUMENT on every gRPC server.

gRPC deserializes a request before any handler runs; a deserializer that raises
(garbage bytes, a truncated varint, invalid UTF-8 in a string field) ends the
call as INTERNAL or UNKNOWN, which says "server bug" for what is client input.
``InputGuard`` is a server interceptor that closes this for every method of
every service at once (kvstore, prefill, decode, router, health, reflection):
it swaps each method's deserializer for a tolerant one and rejects what does
not parse with INVALID_ARGUMENT before the handler sees it, for unary and
streaming requests alike. Errors a handler raises on parsed input stay with
that server's own status table.

Install with ``grpc.aio.server(interceptors=[..., InputGuard()])``; it composes
with authentication interceptors (put those first: an unauthenticated caller
learns nothing about parsing).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["InputGuard", "Unparsable", "tolerant"]


class Unparsable:
    """What a request that failed to deserialize turns into."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, returning ``Unparsable`` instead of raising on bad bytes."""

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # protobuf DecodeError, UnicodeDecodeError, ...
            return Unparsable(exc)

    return deserialize


async def _reject(context: grpc.aio.ServicerContext, method: str, bad: Unparsable) -> None:
    detail = str(bad.error)[:200] or type(bad.error).__name__
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request is not a valid protobuf message ({detail})")


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                   method: str) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, Unparsable):
            await _reject(context, method, item)
        yield item


def _unary_request(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Unparsable):
                await _reject(context, method, request)
            async for item in fn(request, context):
                yield item
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unparsable):
            await _reject(context, method, request)
        return await fn(request, context)
    return call


def _stream_request(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn):
        async def stream(requests: AsyncIterator[Any],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in fn(_checked(requests, context, method), context):
                yield item
        return stream

    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await fn(_checked(requests, context, method), context)
    return call


def guard(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """The same handler with a tolerant deserializer and the rejection in front."""
    if handler is None or handler.request_deserializer is None:
        return handler
    fn = (handler.unary_unary or handler.unary_stream or handler.stream_unary
          or handler.stream_stream)
    if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        return handler   # a sync handler runs in gRPC's thread pool; ours are all async
    swap: dict[str, Any] = {"request_deserializer": tolerant(handler.request_deserializer)}
    if handler.unary_unary is not None:
        swap["unary_unary"] = _unary_request(handler.unary_unary, method)
    elif handler.unary_stream is not None:
        swap["unary_stream"] = _unary_request(handler.unary_stream, method)
    elif handler.stream_unary is not None:
        swap["stream_unary"] = _stream_request(handler.stream_unary, method)
    elif handler.stream_stream is not None:
        swap["stream_stream"] = _stream_request(handler.stream_stream, method)
    return handler._replace(**swap)  # type: ignore[attr-defined]  # a namedtuple


class InputGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return guard(handler, handler_call_details.method)  # type: ignore[return-value]
