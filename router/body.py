"""The one request-body layer of the HTTP front: headers, size, encoding, JSON.

``await read_json_body(request)`` is what every JSON route calls (chat,
completions, and any route added later, e.g. /v1/messages). In order:

1. ``Content-Type`` must be JSON (absent is accepted; a charset other than
   UTF-8 is refused) -> 415;
2. ``Content-Encoding`` must be identity/gzip/x-gzip/deflate -> else 415;
3. the size is checked before anything is parsed: a ``Content-Length`` over
   the limit is refused unread, a chunked body is cut off at the limit -> 413;
4. ``router.body_decode.decode_body`` decodes and parses under strict limits
   -> 400 (413 for a decompression bomb).

Small bodies (``inline_bytes``) decode on the event loop: their worst case is
a few ms. Larger ones decode in a worker process, because ``json.loads`` holds
the GIL for its whole run (a 16 MiB array of empty lists takes ~1.8 s here)
and a thread would stall the loop, i.e. ``/health`` and every stream, just
as long.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from router.body_decode import DECODERS, BodyProblem, DecodeLimits, decode_body, worker_init
from router.errors import (
    InvalidRequestError,
    NoInstanceError,
    PayloadTooLargeError,
    RouterError,
    UnsupportedMediaTypeError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_JSON_TYPES = frozenset({"application/json"})
_IDENTITY = frozenset({"", "identity"})
_READ_CHUNK = 2**16


@dataclass(frozen=True, slots=True)
class BodyLimits:
    decode: DecodeLimits = field(default_factory=DecodeLimits)
    inline_bytes: int = 64 * 2**10   # at most this many decoded on the loop
    # Decoding processes for bigger bodies; one core is left to the event loop.
    workers: int = field(default_factory=lambda: max(1, min(2, (os.cpu_count() or 2) - 1)))

    def __post_init__(self) -> None:
        if self.inline_bytes < 0 or self.workers < 1:
            raise ValueError("BodyLimits.inline_bytes must be >= 0 and workers >= 1")

    @property
    def max_bytes(self) -> int:
        return self.decode.max_bytes


_PROBLEM_ERRORS: dict[str, type[RouterError]] = {
    "invalid": InvalidRequestError,
    "too_large": PayloadTooLargeError,
    "unsupported": UnsupportedMediaTypeError,
}


def problem_error(p: BodyProblem) -> RouterError:
    return _PROBLEM_ERRORS[p.kind](p.message, param=p.param, code=p.code)


def _check_content_type(request: web.Request) -> None:
    raw = request.headers.get("Content-Type")
    if raw is None:
        return                       # curl --data-binary without -H: JSON is the only choice
    media = request.content_type.lower()
    if media not in _JSON_TYPES and not (media.startswith("application/")
                                         and media.endswith("+json")):
        raise UnsupportedMediaTypeError(
            f"Content-Type {raw[:100]!r} is not supported; send application/json",
            param="Content-Type", code="unsupported_media_type")
    charset = (request.charset or "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaTypeError(
            f"charset {charset[:40]!r} is not supported; send UTF-8 JSON",
            param="Content-Type", code="unsupported_media_type")


def _encodings(request: web.Request) -> tuple[str, ...]:
    names: list[str] = []
    for header in request.headers.getall("Content-Encoding", ()):
        for part in header.split(","):
            name = part.strip().lower()
            if name in _IDENTITY:
                continue
            if name not in DECODERS:
                raise UnsupportedMediaTypeError(
                    f"Content-Encoding {name[:40]!r} is not supported; use one of "
                    f"{sorted(DECODERS)} or none", param="Content-Encoding",
                    code="unsupported_encoding")
            names.append(name)
    if len(names) > 2:
        raise UnsupportedMediaTypeError("at most two stacked Content-Encodings are accepted",
                                        param="Content-Encoding", code="unsupported_encoding")
    return tuple(names)


def _too_large(limit: int, what: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the request body is larger than {limit} bytes ({what})",
                                param="body", code="request_too_large")


async def read_raw(request: web.Request, limit: int) -> bytes | bytearray:
    """The body as sent, refused before reading it all when it is over ``limit``."""
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(limit, f"Content-Length {length}")
    buf = bytearray()
    try:
        async for chunk in request.content.iter_chunked(_READ_CHUNK):
            buf += chunk
            if len(buf) > limit:
                raise _too_large(limit, "read so far")
    except RouterError:
        raise
    except (ConnectionError, asyncio.CancelledError):
        raise                        # the client went away: nobody to answer
    except Exception as exc:         # a malformed chunked body, a payload error
        raise InvalidRequestError(f"the request body could not be read: {exc}", param="body",
                                  code="invalid_body") from exc
    return buf                       # not copied: 16 MiB memcpy on the loop for nothing


class BodyReader:
    """Decodes bodies; owns the worker processes for the big ones."""

    def __init__(self, limits: BodyLimits) -> None:
        self.limits = limits
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warming: asyncio.Task[None] | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a forked child would inherit gRPC's threads and sockets.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.limits.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=worker_init)
        return self._pool

    def start(self) -> None:
        """Start the workers in the background, so the first big body does not wait
        for them and the front does not wait to listen (a spawn takes seconds)."""
        loop = asyncio.get_running_loop()
        self._warming = loop.create_task(self._warm(), name="body-decoder-warmup")

    async def _warm(self) -> None:
        loop = asyncio.get_running_loop()
        futs = [loop.run_in_executor(self._executor(), decode_body, b"{}", (),
                                     self.limits.decode) for _ in range(self.limits.workers)]
        try:
            await asyncio.gather(*futs)
        except Exception:  # the first real use retries and reports
            log.warning("body decoding workers did not start", exc_info=True)

    def close(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            self._warming = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def decode(self, raw: bytes | bytearray, encodings: tuple[str, ...]) -> object:
        if len(raw) <= self.limits.inline_bytes and not encodings:
            out = decode_body(raw, encodings, self.limits.decode)
        else:
            loop = asyncio.get_running_loop()
            try:
                out = await loop.run_in_executor(self._executor(), decode_body, raw, encodings,
                                                 self.limits.decode)
            except BrokenProcessPool as exc:   # a worker died (killed, out of memory)
                log.error("body decoding worker died; restarting the pool")
                self.close()
                raise NoInstanceError("the body decoder restarted; retry the request") from exc
        if out.problem is not None:
            raise problem_error(out.problem)
        return out.value

    async def read_json(self, request: web.Request) -> object:
        _check_content_type(request)
        encodings = _encodings(request)
        raw = await read_raw(request, self.limits.max_bytes)
        return await self.decode(raw, encodings)


BODY_READER_KEY = web.AppKey("kvserve_body_reader", BodyReader)


async def read_json_body(request: web.Request) -> object:
    """The decoded JSON body of a request to the front app (any route)."""
    return await request.app[BODY_READER_KEY].read_json(request)


async def parse_json_body(request: web.Request, parse: Callable[..., T], **kwargs: Any) -> T:
    """``parse(body, **kwargs)`` of the decoded body, on a thread (a big body's
    walk is Python work: a thread yields the GIL every few ms, unlike one C call).

    Whatever ``parse`` raises besides a ``RouterError`` is a parser bug met by
    client input: logged with its traceback, answered 400 (never a 500)."""
    body = await read_json_body(request)
    try:
        return await asyncio.to_thread(parse, body, **kwargs)
    except RouterError:
        raise
    except Exception as exc:
        log.exception("parsing a %s body raised %s (a parser bug; answered 400)",
                      request.path, type(exc).__name__)
        raise InvalidRequestError(f"the request body could not be parsed ({type(exc).__name__})",
                                  param="body", code="invalid_body") from exc


def install(app: web.Application, limits: BodyLimits) -> BodyReader:
    """Give ``app`` its reader, started with the app and stopped with it."""
    reader = BodyReader(limits)
    app[BODY_READER_KEY] = reader

    async def on_startup(_: web.Application) -> None:
        reader.start()

    async def on_cleanup(_: web.Application) -> None:
        reader.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return reader
