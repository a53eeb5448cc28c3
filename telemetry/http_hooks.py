"""W3C trace context on the HTTP front: an aiohttp middleware that starts the
trace of every API request (``/v1/...``), joining the client's
``traceparent`` when it sent a valid one, and answers with the trace's id in
``traceresponse`` so a client can find its trace.

``install(app)`` does nothing while tracing is off: no per-request cost.
It puts the middleware first, so the span covers the error mapping and the
whole streamed answer, and stamps ``traceresponse`` on every answer (streamed
ones too) just before its headers go out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from telemetry import tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

TRACERESPONSE = "traceresponse"
_SPAN_KEY = "kvserve_trace_span"


def install(app: web.Application) -> None:
    """Trace ``app``'s API requests (call before the app starts)."""
    if not tracing.enabled():
        return
    app.middlewares.insert(0, trace_middleware)
    app.on_response_prepare.append(_stamp)


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    entered = request.get(_SPAN_KEY)
    if entered is not None:
        response.headers[TRACERESPONSE] = tracing.traceparent(entered.span)


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def trace_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith("/v1/"):
        return await handler(request)       # probes and scrapes are not requests
    route = _route(request)
    carrier = {k: request.headers[k] for k in (tracing.TRACEPARENT, tracing.TRACESTATE)
               if k in request.headers}
    entered = tracing.enter(f"{request.method} {route}", carrier, root=True,
                            **{"http.request.method": request.method, "http.route": route})
    if entered is None:
        return await handler(request)
    request[_SPAN_KEY] = entered
    error = ""
    try:
        resp = await handler(request)
        entered.set(**{"http.response.status_code": resp.status})
        if resp.status >= 500:
            error = str(resp.status)
        return resp
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        entered.leave(error)
