"""The OpenAI-compatible HTTP front (aiohttp).

Routes: POST /v1/chat/completions, POST /v1/completions (JSON or SSE),
GET /v1/models, GET /health, GET /metrics, vLLM's POST /tokenize and /detokenize
(router.tokenize_http), and for operators POST
/reset_prefix_cache (router.operator_http). Each handler only translates:
headers -> ``Caller`` (auth.py), body -> typed request (openai_schema.py),
``GenEvent``s -> OpenAI bodies (openai_responses.py). One middleware turns
every exception into an OpenAI error body via ``errors.http_error``.

Streaming waits for the first generated event before sending the 200 and the
SSE headers, so everything that can fail before the first token (no live
instance, a retry that ran out, a prompt longer than the context) is a real
HTTP status; only a failure after that point is reported in-stream, as an
``error`` data event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.auth import Caller, identify
from router.body import install, parse_json_body
from router.chat_plan import chat_shapes, plan_chat
from router.errors import (
    MethodNotAllowedError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RouteNotFoundError,
    RouterError,
    http_error,
)
from router.front_config import FrontConfig, Generator
from router.generation import GenEvent, RouteRequest, Usage
from router.messages_api import MessagesApi
from router.metrics import RouterMetrics
from router.openai_responses import (
    SSE_DONE,
    ChatShapes,
    CompletionShapes,
    ResponseIds,
    Shapes,
    models_body,
    sse,
)
from router.openai_schema import parse_chat_request, parse_completion_request
from router.operator_http import OperatorEndpoints
from router.session import session_from
from router.tokenize_http import TokenizeEndpoints
from telemetry.http_hooks import install as install_tracing

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"          # ours, in every reply
CLIENT_ID_HEADERS = ("X-Client-Request-Id", "X-Request-Id")   # the client's, echoed back
CLIENT_ID_REPLY = "X-Client-Request-Id"
# Where the request ran: useful to operators and to tests that kill an instance.
PREFILL_HEADER = "X-KV-Prefill-Instance"
DECODE_HEADER = "X-KV-Decode-Instance"


_APP_KEY = web.AppKey("kvserve_front", object)
_ENDPOINT_KEY = "kvserve_endpoint"


def _with_session(parse: Callable[..., Any], headers: Any) -> Callable[..., Any]:
    """``parse`` that also returns the request's session (header, else body field)."""
    def both(body: object, **kwargs: Any) -> tuple[Any, str]:
        return parse(body, **kwargs), session_from(headers, body)
    return both


@dataclass(slots=True)
class Front:
    cfg: FrontConfig
    core: Generator
    metrics: RouterMetrics

    # -- plumbing -----------------------------------------------------------------

    def _caller(self, request: web.Request) -> Caller:
        return identify(request.headers, self.cfg.api_keys, self.cfg.classes)

    @staticmethod
    def request_id(request: web.Request) -> str:
        """Ours, always (internal keys derive from it and must be unguessable);
        the client's own id is only logged beside it and echoed back."""
        rid = secrets.token_hex(16)
        client = _client_id(request)
        if client:
            log.info("request %s is the client's %r", rid, client)
        return rid

    # -- handlers ----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        # Decoded under limits, parsed on a thread; a parser bug is a 400 (router.body).
        parsed, session = await parse_json_body(request, _with_session(parse_chat_request,
                                                                        request.headers),
                                                served_model=self.cfg.model_name,
                                                max_context=self.cfg.max_context)
        # Tools rendered in, the grammar of a forced call or response_format set.
        plan = plan_chat(parsed.messages, parsed.sampling, parsed.tools, parsed.response_format)
        route = RouteRequest(request_id=self.request_id(request), tenant=caller.tenant,
                             traffic_class=caller.traffic_class, api_key_id=caller.key_id,
                             sampling=plan.sampling,
                             messages=plan.messages, session_id=session)
        shapes = chat_shapes(ChatShapes(ResponseIds(self.cfg.model_name, chat=True),
                                        include_usage=parsed.stream.include_usage), plan.tools)
        return await self._respond(request, route, shapes, stream=parsed.stream.enabled)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        parsed, session = await parse_json_body(request, _with_session(parse_completion_request,
                                                                        request.headers),
                                                served_model=self.cfg.model_name,
                                                max_context=self.cfg.max_context,
                                                vocab_size=self.cfg.vocab_size)
        prompt, token_ids = ((parsed.prompt, ()) if isinstance(parsed.prompt, str)
                             else ("", parsed.prompt))
        route = RouteRequest(request_id=self.request_id(request), tenant=caller.tenant,
                             traffic_class=caller.traffic_class, api_key_id=caller.key_id,
                             sampling=parsed.sampling,
                             prompt=prompt, token_ids=token_ids, session_id=session)
        shapes = CompletionShapes(ResponseIds(self.cfg.model_name, chat=False),
                                  include_usage=parsed.stream.include_usage)
        return await self._respond(request, route, shapes, stream=parsed.stream.enabled)

    async def models(self, request: web.Request) -> web.Response:
        self._caller(request)
        return web.json_response(models_body(self.cfg.model_name, self.cfg.created))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the model object, or a 404 OpenAI error."""
        self._caller(request)
        model_id = request.match_info["model_id"]
        if model_id != self.cfg.model_name:
            raise ModelNotFoundError(model_id, self.cfg.model_name)
        (obj,) = models_body(self.cfg.model_name, self.cfg.created)["data"]
        return web.json_response(obj)

    async def health(self, request: web.Request) -> web.Response:
        counts = self.core.live_counts()
        ready = counts.get("prefill", 0) > 0 and counts.get("decode", 0) > 0
        return web.json_response({"status": "ok" if ready else "no_instances",
                                  "model": self.cfg.model_name, "instances": counts},
                                 status=200 if ready else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        for role, n in self.core.live_counts().items():
            self.metrics.instances.labels(role=role).set(n)
        if self.metrics.vllm is not None:
            self.metrics.vllm.in_flight(self.metrics.in_flight_now)
        body, content_type = self.metrics.exposition()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    # -- generation ----------------------------------------------------------------

    async def _respond(self, request: web.Request, route: RouteRequest, shapes: Shapes, *,
                       stream: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        events = self.core.generate(route)
        try:
            try:
                first = await anext(events)
            except StopAsyncIteration:
                raise RouterError("the generation ended without any event") from None
            self.metrics.ttft_seconds.observe(time.perf_counter() - t0)
            if self.metrics.vllm is not None:
                self.metrics.vllm.first_token(time.perf_counter() - t0)
            if not stream:
                resp: web.StreamResponse = await self._whole(request, route, events, first,
                                                             shapes)
            else:
                resp = await self._stream(request, route, events, first, shapes)
            if self.metrics.vllm is not None:
                self.metrics.vllm.e2e.labels(self.cfg.model_name, "0").observe(
                    time.perf_counter() - t0)
            return resp
        finally:
            # Whatever happened (done, failed, client gone): end the decode stream.
            await events.aclose()

    async def _whole(self, request: web.Request, route: RouteRequest,
                     events: AsyncGenerator[GenEvent, None], first: GenEvent,
                     shapes: Shapes) -> web.Response:
        parts = [first.text]
        last = first
        async for ev in events:
            parts.append(ev.text)
            last = ev
        usage = self.finish(last)
        body = shapes.whole("".join(parts), last.finish_reason or "stop", usage)
        return web.json_response(body, headers=self._headers(request, route, first))

    async def _stream(self, request: web.Request, route: RouteRequest,
                      events: AsyncGenerator[GenEvent, None], first: GenEvent,
                      shapes: Shapes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           **self._headers(request, route, first)})
        await resp.prepare(request)
        try:
            if first.text and not first.finished:
                await resp.write(sse(shapes.chunk(first.text)))
            last = first
            if not first.finished:
                async for ev in events:
                    last = ev
                    if ev.text and not ev.finished:
                        await resp.write(sse(shapes.chunk(ev.text)))
                    if ev.finished:
                        break
            if not last.finished:
                raise RouterError("the generation stream ended before it finished")
            await resp.write(sse(shapes.chunk(last.text, last.finish_reason or "stop")))
            usage = self.finish(last)
            if shapes.include_usage:
                await resp.write(sse(shapes.usage_chunk(usage)))
        except ConnectionError:
            # The client went away: stop generating (the caller closes the iterator,
            # which cancels the decode stream) and answer nobody.
            log.info("client of %s disconnected mid-stream", route.request_id)
            return resp
        except Exception as exc:  # headers are sent: report in-stream
            err = http_error(exc)
            log.warning("request %s failed mid-stream: %s", route.request_id,
                        err.body["error"]["message"])
            self.metrics.stream_errors.inc()
            with contextlib.suppress(ConnectionError):
                await resp.write(sse(err.body))
        with contextlib.suppress(ConnectionError):
            await resp.write(SSE_DONE)
            await resp.write_eof()
        return resp

    @staticmethod
    def _headers(request: web.Request, route: RouteRequest, first: GenEvent) -> dict[str, str]:
        out = {REQUEST_ID_HEADER: route.request_id, PREFILL_HEADER: first.prefill_instance,
               DECODE_HEADER: first.decode_instance}
        client = _client_id(request)
        if client:
            out[CLIENT_ID_REPLY] = client
        return out


    def finish(self, last: GenEvent) -> Usage:
        if not last.finished or last.usage is None:
            raise RouterError("the generation stream ended without its usage")
        usage = last.usage
        if self.metrics.vllm is not None:
            self.metrics.vllm.finished(usage.prompt_tokens, usage.cached_tokens,
                                       usage.completion_tokens, last.finish_reason)
        self.metrics.tokens.labels(kind="prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels(kind="cached").inc(usage.cached_tokens)
        self.metrics.tokens.labels(kind="completion").inc(usage.completion_tokens)
        return usage


def _client_id(request: web.Request) -> str:
    """The client's request id, if it sent a printable one (cut to 128 characters)."""
    for name in CLIENT_ID_HEADERS:
        given = request.headers.get(name, "")
        if given and given.isprintable() and given.isascii():
            return given[:128]
    return ""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# aiohttp's own HTTP exceptions (unknown path, wrong method, body too large) as ours.
_HTTP_EXC: dict[int, Callable[[web.Request], RouterError]] = {
    404: lambda r: RouteNotFoundError(f"no route {r.method} {r.path}"),
    405: lambda r: MethodNotAllowedError(f"method {r.method} not allowed on {r.path}"),
    413: lambda r: PayloadTooLargeError("request body too large", param="body",
                                        code="request_too_large"),
}


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    front: Front = request.app[_APP_KEY]  # type: ignore[assignment]
    t0 = time.perf_counter()
    # Probes and scrapes are not load: only API calls count as in flight.
    api = request.path.startswith("/v1/")
    if api:
        front.metrics.begin_request()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        _echo_client_id(request, resp)
        return resp
    except asyncio.CancelledError:
        status = 499                 # the client closed the connection (nginx's code)
        raise
    except web.HTTPException as exc:
        make = _HTTP_EXC.get(exc.status)
        if make is None:
            if exc.status < 400:
                raise
            err = http_error(RouterError(exc.reason))
            err.body["error"]["type"] = "invalid_request_error"
            status = exc.status
        else:
            err = http_error(make(request))
            status = err.status
        return _echo_client_id(request, web.json_response(err.body, status=status))
    except Exception as exc:  # every failure becomes an OpenAI error body
        err = http_error(exc)
        status = err.status
        if status >= 500:
            # A 5xx that is not a RouterError is our bug: log it with its traceback.
            log.error("request %s %s failed: %s", request.method, request.path,
                      err.body["error"]["message"], exc_info=not isinstance(exc, RouterError))
        return _echo_client_id(request, web.json_response(err.body, status=status,
                                                          headers=err.headers))
    finally:
        if api:
            front.metrics.end_request()
        endpoint = request.match_info.route.resource.canonical if (
            request.match_info.route.resource is not None) else "unmatched"
        front.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        front.metrics.request_seconds.labels(endpoint=endpoint).observe(time.perf_counter() - t0)


def _echo_client_id(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    client = _client_id(request)
    if client and not resp.prepared:
        resp.headers[CLIENT_ID_REPLY] = client
    return resp


def make_app(cfg: FrontConfig, core: Generator, metrics: RouterMetrics,
             ops: Any = None, tokenize: TokenizeEndpoints | None = None) -> web.Application:
    """``ops``: router.cluster_ops.ClusterOps, what the operator endpoints act with;
    ``tokenize``: vLLM's /tokenize and /detokenize (router.tokenize_http)."""
    front = Front(cfg, core, metrics)
    app = web.Application(middlewares=[_error_middleware], client_max_size=cfg.max_body_bytes)
    app[_APP_KEY] = front
    install(app, cfg.body_limits())
    install_tracing(app)             # the trace of each API request (none while off)
    app.router.add_post("/v1/chat/completions", front.chat)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/messages", MessagesApi(front).handle)   # router/messages_api.py
    app.router.add_get("/v1/models", front.models)
    app.router.add_get("/v1/models/{model_id:.+}", front.model)    # ids may hold a "/"
    app.router.add_get("/health", front.health)
    app.router.add_get("/metrics", front.metrics_handler)
    OperatorEndpoints(cfg.operator_key, cfg.operator_open, ops).install(app)
    if tokenize is not None:
        tokenize.install(app, front._caller)
    return app
