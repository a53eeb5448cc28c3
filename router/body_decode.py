"""Request bytes -> a JSON value, under strict limits (pure; stdlib only).

One function, ``decode_body``, undoes the Content-Encoding, decodes UTF-8
strictly and parses strict JSON, and checks the parsed tree. Every way a
body can be bad comes back as a ``BodyProblem`` (never an exception out of
here), so the caller maps all of them to one 4xx in one place. It imports
nothing but the standard library because big bodies run it in a worker
process (``router.body``), which should start fast and hold no sockets.

What "strict" means, each closing a class of inputs that used to reach the
handlers as a 500 or a stall:

- decompressed size is capped while decompressing (no decompression bombs);
- text must be UTF-8 (no BOM), JSON must be RFC 8259 (no NaN/Infinity);
- integers have at most ``max_int_digits`` digits (Python refuses > 4,300 at
  ``int()`` time, far beyond any count a request needs);
- numbers must be finite as floats (``1e400`` is refused, not turned into inf);
- nesting is at most ``max_depth`` deep and the tree holds at most
  ``max_values`` values (bounded work for every later walk of it);
- no string (key or value) holds a lone surrogate (``"\\ud800"`` parses in
  Python but cannot be encoded to UTF-8 later).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    max_bytes: int = 16 * 2**20      # after decompression too
    max_depth: int = 64
    max_values: int = 2**18
    max_int_digits: int = 64

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_values", "max_int_digits"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeLimits.{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class BodyProblem:
    """Why a body was refused: ``kind`` picks the status (see router.body)."""

    kind: str                        # "invalid" | "too_large" | "unsupported"
    message: str
    code: str
    param: str = "body"


@dataclass(frozen=True, slots=True)
class Decoded:
    value: object = None
    problem: BodyProblem | None = None


class _Refused(Exception):
    def __init__(self, problem: BodyProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def _invalid(message: str, code: str = "invalid_json", param: str = "body") -> _Refused:
    return _Refused(BodyProblem("invalid", message, code, param))


def _inflate(data: bytes | bytearray, wbits: int, limit: int, name: str) -> bytes:
    d = zlib.decompressobj(wbits=wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise _invalid(f"the body is not valid {name} data ({exc})", "invalid_encoding") from exc
    if len(out) > limit or d.unconsumed_tail:
        raise _Refused(BodyProblem("too_large", f"the {name}-decoded body exceeds {limit} bytes",
                                   "request_too_large"))
    if not d.eof:
        raise _invalid(f"the {name} body is truncated", "invalid_encoding")
    if d.unused_data:
        raise _invalid(f"{len(d.unused_data)} bytes of trailing data after the {name} stream",
                       "invalid_encoding")
    return out


def _gunzip(data: bytes | bytearray, limit: int) -> bytes:
    return _inflate(data, 16 + zlib.MAX_WBITS, limit, "gzip")


def _deflate(data: bytes | bytearray, limit: int) -> bytes:
    # RFC 9110 deflate is the zlib format; some clients send raw deflate.
    try:
        return _inflate(data, zlib.MAX_WBITS, limit, "deflate")
    except _Refused as zlib_format:
        if zlib_format.problem.kind != "invalid":
            raise
        try:
            return _inflate(data, -zlib.MAX_WBITS, limit, "deflate")
        except _Refused:
            raise zlib_format from None


# Content-Encoding name -> decoder. "identity" never reaches here.
DECODERS: dict[str, Callable[[bytes | bytearray, int], bytes]] = {
    "gzip": _gunzip, "x-gzip": _gunzip, "deflate": _deflate,
}


def _refuse_constant(name: str) -> float:
    raise _invalid(f"{name} is not valid JSON (numbers must be finite)")


def _decoder(limits: DecodeLimits) -> json.JSONDecoder:
    def parse_int(s: str) -> int:
        if len(s) - s.startswith("-") > limits.max_int_digits:
            raise _invalid(f"an integer of {len(s)} digits is out of range (at most "
                           f"{limits.max_int_digits})", "number_out_of_range")
        return int(s)

    def parse_float(s: str) -> float:
        if len(s) > 4 * limits.max_int_digits:
            raise _invalid(f"a number of {len(s)} characters is out of range",
                           "number_out_of_range")
        f = float(s)
        if not math.isfinite(f):
            raise _invalid(f"the number {s[:40]} is out of range (not a finite float)",
                           "number_out_of_range")
        return f

    return json.JSONDecoder(parse_int=parse_int, parse_float=parse_float,
                            parse_constant=_refuse_constant)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _precount(data: bytes | bytearray, limits: DecodeLimits) -> None:
    """Refuse, at memchr speed, a body that surely holds too many values, before
    ``json.loads`` spends seconds on it (16 MiB of ``[],`` takes ~1.8 s). Lower
    bounds only, so nothing valid is refused: every string literal has two real
    quotes (``\\"`` may or may not be one) and pairs with at least one value; with
    no string at all, every ``,`` adds a value and every ``[``/``{`` opens one. A
    crafted body can still cost a worker its parse time, never the event loop."""
    quotes = data.count(b'"')
    at_least = (quotes - data.count(b'\\"')) // 4
    if not quotes:
        at_least = max(data.count(b","), data.count(b"[") + data.count(b"{"))
    if at_least >= limits.max_values:
        raise _invalid(f"the body holds more than {limits.max_values} JSON values",
                       "too_many_values")


def _path(parent: str, key: object) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _check_str(s: str, where: str) -> None:
    # isascii() is O(1) on CPython's compact strings: only non-ASCII text is scanned.
    if not s.isascii() and _SURROGATE.search(s):
        raise _invalid(f"{where or 'a string'} holds a lone UTF-16 surrogate, which is not "
                       "text", "invalid_string", where or "body")


def check_tree(value: object, limits: DecodeLimits) -> None:
    """Depth, size and string checks over a parsed value, iteratively (no recursion)."""
    stack: list[tuple[object, int, str]] = [(value, 1, "")]
    seen = 0
    while stack:
        v, depth, where = stack.pop()
        seen += 1
        if seen > limits.max_values:
            raise _invalid(f"the body holds more than {limits.max_values} JSON values",
                           "too_many_values")
        if isinstance(v, str):
            _check_str(v, where)
        elif isinstance(v, dict | list):
            if depth > limits.max_depth:
                raise _invalid(f"the body is nested deeper than {limits.max_depth} levels",
                               "too_deep")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, child in items:
                if isinstance(k, str):
                    _check_str(k, where)
                stack.append((child, depth + 1, _path(where, k)))


def decode_body(raw: bytes | bytearray, encodings: tuple[str, ...],
                limits: DecodeLimits) -> Decoded:
    """``raw`` with ``encodings`` (in the order they were applied) -> a JSON value."""
    try:
        data: bytes | bytearray = raw
        for name in reversed(encodings):
            data = DECODERS[name](data, limits.max_bytes)
        if data.startswith(b"\xef\xbb\xbf"):
            raise _invalid("the body starts with a UTF-8 byte order mark; send plain UTF-8",
                           "invalid_encoding")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _invalid(f"the body is not valid UTF-8 (byte {exc.start})",
                           "invalid_encoding") from exc
        if not text.strip():
            raise _invalid("the request body is empty; send a JSON object", "empty_body")
        _precount(data, limits)
        try:
            value = _decoder(limits).decode(text)
        except json.JSONDecodeError as exc:
            raise _invalid(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise _invalid(f"the body is nested deeper than {limits.max_depth} levels",
                           "too_deep") from exc
        except ValueError as exc:     # int() limits, should parse_int ever let one by
            raise _invalid(f"a number in the body is out of range: {exc}",
                           "number_out_of_range") from exc
        check_tree(value, limits)
    except _Refused as r:
        return Decoded(problem=r.problem)
    return Decoded(value=value)


def worker_init() -> None:
    """In a decoding worker process: die with the router. A SIGKILLed router
    cannot shut its pool down, and an idle worker would wait forever on its queue."""
    parent = os.getppid()
    with contextlib.suppress(OSError):
        os.nice(5)                             # behind the router's event loop
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:                       # elsewhere, or if prctl was refused
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
