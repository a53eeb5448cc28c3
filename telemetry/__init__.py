"""Observability shared by every service: request tracing (OpenTelemetry, off
and free unless an OTLP endpoint is configured) and its gRPC and HTTP hooks.

Layer 0: imports nothing of the project, so every package may use it.
"""

from telemetry.tracing import annotate, enabled, record, setup, span

__all__ = ["annotate", "enabled", "record", "setup", "span"]
