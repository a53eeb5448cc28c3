"""Serving the front app so that even aiohttp's own refusals are OpenAI errors.

A request aiohttp's HTTP parser refuses (an over-long header line, too many
headers, a bad request line or chunk framing) never reaches the app's
middleware: aiohttp answers it itself, in plain text, from
``RequestHandler.handle_error``. ``FrontRunner`` serves the app with a
handler whose ``handle_error`` answers with the same OpenAI error body as
every other failure. It also sets the front's protocol options in one place:
no automatic request decompression (``router.body`` decodes bodies under
limits) and handler cancellation when a client disconnects (its prefill and
decode calls are cancelled with it).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.errors import HeaderError, HeaderTooLargeError, RouterError, error_body, http_error

log = logging.getLogger(__name__)

# aiohttp's parser errors -> ours; the first match in order wins (subclasses first).
_PARSER_ERRORS: tuple[tuple[type[BaseException], type[RouterError]], ...] = (
    (http_exceptions.LineTooLong, HeaderTooLargeError),
    (http_exceptions.BadHttpMessage, HeaderError),
)


def _as_router_error(status: int, exc: BaseException | None, message: str | None) -> Exception:
    for kind, ours in _PARSER_ERRORS:
        if isinstance(exc, kind):
            text = getattr(exc, "message", "") or message or type(exc).__name__
            return ours(f"malformed HTTP request: {str(text)[:300]}", param="headers",
                        code="invalid_http_request")
    if 400 <= status < 500:
        return HeaderError(f"malformed HTTP request: {(message or '')[:300]}", param="headers",
                           code="invalid_http_request")
    return exc if isinstance(exc, Exception) else RuntimeError(message or "internal error")


class _JsonErrorHandler(RequestHandler):
    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:    # mid-response: aiohttp's own rule applies
            return super().handle_error(request, status, exc, message)
        err = http_error(_as_router_error(status, exc, message))
        if err.status >= 500:
            log.error("HTTP request failed outside the app: %s", message, exc_info=exc)
        else:
            log.info("refused a malformed HTTP request: %s", err.body["error"]["message"])
        resp = web.Response(status=err.status, text=err.json(), content_type="application/json")
        resp.force_close()
        return resp


    async def finish_response(self, request: BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        # An aiohttp HTTPException raised outside the app's middleware (a failed
        # ``Expect:`` check) would go out as aiohttp's plain text: make it ours.
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and not resp.prepared:
            body = error_body(resp.text or resp.reason or "malformed HTTP request",
                              error_type="invalid_request_error", param="headers",
                              code="invalid_http_request")
            resp = web.json_response(body, status=resp.status)
        return await super().finish_response(request, resp, start_time)


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class FrontRunner(web.AppRunner):
    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("handler_cancellation", True)
        kwargs.setdefault("auto_decompress", False)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The app's server, built by aiohttp as usual; only its handler class differs.
        server.__class__ = _JsonErrorServer
        return server
