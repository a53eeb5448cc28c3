"""Request tracing: one OpenTelemetry trace per request across the services.

A process calls ``setup("prefill")`` once at start. Tracing is on when an
OTLP endpoint is configured with the standard variables
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``;
protocol from ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, ``http/protobuf`` by
default as the specification says) and not switched off
(``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``). Everything else
the SDK reads itself: sampler, headers, batch delays, certificates.

Off, every call below is a constant-time no-op (one module-global test, no
allocation beyond the caller's keyword dict) and the gRPC and HTTP hooks are
not even installed: a process without an endpoint pays nothing per request.

Spans are made only inside a trace. A trace starts at the router's HTTP front
(joining the client's ``traceparent`` if it sent one) or at a gRPC server
that received a ``traceparent``; ``span()`` under no trace does nothing, so
background work (write-back, heartbeats, health probes) makes no traces.

The current span lives in a context variable of our own rather than in
OpenTelemetry's context: grpc.aio may close a streaming handler from another
task, where detaching an OpenTelemetry context token only logs errors, while
resetting our variable there is simply skipped.

Attributes carry counts, tiers, bytes, classes, instance ids and tenant
namespace ids, never prompt text, tenant names or secrets
(docs/operators.md, "Tracing").
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_ON = False
_TRACER: Any = None                  # opentelemetry.trace.Tracer when on
_PROVIDER: Any = None
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("kvserve_span", default=None)

Attr = str | int | float | bool


class SpanHandle:
    """What ``span()`` yields: lets the code inside add attributes it learns."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, **attrs: Attr) -> None:
        self._span.set_attributes(_clean(attrs))

    def fail(self, reason: str) -> None:
        """Mark the span failed; ``reason`` is a code or type name, never user text."""
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, reason))


class _NullHandle(SpanHandle):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(None)

    def set(self, **attrs: Attr) -> None:
        return None

    def fail(self, reason: str) -> None:
        return None


NULL = _NullHandle()


class _NullSpan:
    """The context manager ``span()`` returns when there is nothing to record."""

    __slots__ = ()

    def __enter__(self) -> SpanHandle:
        return NULL

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


def enabled() -> bool:
    return _ON


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for trace export."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(role: str, *, instance: str = "",
          environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on for this process (service ``kvserve-<role>``) when the
    environment asks for it. Idempotent; returns whether tracing is on."""
    global _ON, _TRACER, _PROVIDER
    if _ON or not wanted(environ):
        return _ON
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = _exporter(protocol)
    except ImportError as exc:
        log.error("tracing is configured (OTEL_EXPORTER_OTLP_*) but %s is missing; tracing "
                  "stays off (pip install 'kvserve[otel]')", exc.name)
        return False
    attrs: dict[str, str] = {"service.name": f"kvserve-{role}", "service.namespace": "kvserve"}
    if instance:
        attrs["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _PROVIDER = provider
    _TRACER = provider.get_tracer("kvserve")
    _ON = True
    log.info("tracing on: OTLP %s, service kvserve-%s", protocol, role)
    return True


def _exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )
        return HttpExporter()
    raise ValueError(f"OTLP protocol {protocol!r} is not supported; use grpc or http/protobuf")


def shutdown() -> None:
    """Flush and stop the exporter (also registered at exit by the SDK)."""
    global _ON
    if _PROVIDER is not None:
        _PROVIDER.shutdown()
    _ON = False


# -- spans ------------------------------------------------------------------------------------
def span(name: str, **attrs: Attr) -> Any:
    """``with span("restore", blocks=3) as s: ...; s.set(bytes=n)``: a child of
    the current span, current itself inside the block. A no-op outside a trace."""
    if not _ON:
        return _NULL_SPAN
    parent = _CURRENT.get()
    if parent is None:
        return _NULL_SPAN
    return _child(name, parent, attrs)


@contextlib.contextmanager
def _child(name: str, parent: Any, attrs: dict[str, Attr]) -> Iterator[SpanHandle]:
    from opentelemetry import trace

    s = _TRACER.start_span(name, context=trace.set_span_in_context(parent),
                           attributes=_clean(attrs))
    token = _CURRENT.set(s)
    try:
        yield SpanHandle(s)
    except BaseException as exc:
        SpanHandle(s).fail(type(exc).__name__)
        raise
    finally:
        _reset(token)
        s.end()


def record(name: str, start_s: float, end_s: float, **attrs: Attr) -> None:
    """A finished child span of the current one, from ``time.time()`` stamps:
    for work measured elsewhere (an engine thread, a queue)."""
    if not _ON:
        return
    parent = _CURRENT.get()
    if parent is None:
        return
    from opentelemetry import trace

    s = _TRACER.start_span(name, context=trace.set_span_in_context(parent),
                           attributes=_clean(attrs), start_time=int(start_s * 1e9))
    s.end(end_time=int(max(end_s, start_s) * 1e9))


def active() -> bool:
    """Whether the caller runs inside a trace (worth measuring for spans)."""
    return _ON and _CURRENT.get() is not None


def annotate(**attrs: Attr) -> None:
    """Attributes on the current span (no-op outside a trace)."""
    if not _ON:
        return
    s = _CURRENT.get()
    if s is not None:
        s.set_attributes(_clean(attrs))


def now() -> float:
    """The clock ``record`` takes (wall time, as spans are stamped)."""
    return time.time()


# -- entering and leaving a trace (the hooks) ------------------------------------------------
class Entered:
    """A server span opened by a hook; ``leave`` ends it and restores the caller's span."""

    __slots__ = ("_token", "span")

    def __init__(self, span_: Any, token: contextvars.Token[Any]) -> None:
        self.span = span_
        self._token = token

    def set(self, **attrs: Attr) -> None:
        self.span.set_attributes(_clean(attrs))

    def leave(self, error: str = "") -> None:
        if error:
            SpanHandle(self.span).fail(error)
        _reset(self._token)
        self.span.end()


def enter(name: str, carrier: Mapping[str, str] | None, *, root: bool,
          kind: str = "server", **attrs: Attr) -> Entered | None:
    """Open the span of an incoming call and make it current. ``carrier`` holds
    its ``traceparent``/``tracestate``; without a valid one a new trace starts
    only when ``root`` (the HTTP front), else nothing is traced (None)."""
    if not _ON:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = None
    if carrier and carrier.get(TRACEPARENT):
        ctx = TraceContextTextMapPropagator().extract(
            {k: v for k, v in carrier.items() if k in (TRACEPARENT, TRACESTATE)})
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            ctx = None                      # malformed: ignored, as the W3C spec says
    if ctx is None and not root:
        return None
    span_kind = trace.SpanKind.SERVER if kind == "server" else trace.SpanKind.CONSUMER
    s = _TRACER.start_span(name, context=ctx, kind=span_kind, attributes=_clean(attrs))
    return Entered(s, _CURRENT.set(s))


def start_client(name: str, **attrs: Attr) -> Any | None:
    """A CLIENT span for an outgoing call of the current trace (None outside one);
    the caller ends it."""
    if not _ON:
        return None
    parent = _CURRENT.get()
    if parent is None:
        return None
    from opentelemetry import trace

    return _TRACER.start_span(name, context=trace.set_span_in_context(parent),
                              kind=trace.SpanKind.CLIENT, attributes=_clean(attrs))


def traceparent(span_: Any = None) -> str:
    """The W3C ``traceparent`` of ``span_`` (default: the current span), or ""."""
    s = span_ if span_ is not None else _CURRENT.get()
    if s is None:
        return ""
    sc = s.get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _reset(token: contextvars.Token[Any]) -> None:
    # A streaming handler closed from another task: that task's context never
    # held this value, and there is nothing to restore there.
    with contextlib.suppress(ValueError):
        _CURRENT.reset(token)


def _clean(attrs: Mapping[str, Any]) -> dict[str, Attr]:
    """``kvserve.``-prefixed attributes of the allowed types (None dropped)."""
    out: dict[str, Attr] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        key = k if "." in k else f"kvserve.{k}"
        out[key] = v if isinstance(v, str | int | float | bool) else str(v)
    return out
