"""Tracing off costs nothing and installs nothing; on, the gRPC hooks carry
W3C trace context and a real OTLP receiver process gets one connected trace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from telemetry import tracing
from telemetry.grpc_hooks import client_interceptors, server_interceptors
from tests.telemetry.stack import _first_line


def test_off_by_default_and_free() -> None:
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                               "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                               "OTEL_TRACES_EXPORTER": "none"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"})
    assert not tracing.setup("test", environ={})
    assert not tracing.enabled()
    # Off: no hooks are installed at all, and the span API hands out one shared no-op.
    assert server_interceptors() == [] and client_interceptors() == []
    with tracing.span("restore", blocks=3) as s:
        s.set(bytes=1)
    assert tracing.span("a") is tracing.span("b")
    assert tracing.traceparent() == "" and not tracing.active()
    tracing.record("queue", 0.0, 1.0)
    tracing.annotate(x=1)
    assert tracing.enter("x", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
                         root=True) is None


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    out = tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.telemetry.otlp_receiver", "--out",
                             str(out)], stdout=subprocess.PIPE, text=True)
    try:
        yield int(_first_line(proc, "OTLP_RECEIVER ", 30).split()[1]), out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_grpc_hooks_make_one_connected_trace(receiver: tuple[int, Path], protocol: str,
                                             tmp_path: Path) -> None:
    port, out = receiver
    if protocol != "grpc":
        # OTLP/HTTP needs an HTTP receiver: the exporter must fail cleanly, not the call.
        port = 9   # discard port: nothing listens
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
    run = subprocess.run([sys.executable, "-m", "tests.telemetry.traced_call", "unit"], env=env,
                         text=True, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    if protocol != "grpc":
        return
    traceparent = run.stdout.strip()
    trace_id = traceparent.split("-")[1]
    spans = [json.loads(line) for line in out.read_text().splitlines()]
    assert {s["trace_id"] for s in spans} == {trace_id}      # the untraced call made none
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    (root,) = by_name["request"]
    (work,) = by_name["work"]
    (queue,) = by_name["queue"]
    assert work["parent_span_id"] == root["span_id"] == traceparent.split("-")[2]
    assert queue["parent_span_id"] == work["span_id"]
    assert queue["end_ns"] - queue["start_ns"] == pytest.approx(10_000_000, abs=1_000)
    assert work["attributes"] == {"kvserve.blocks": 3, "kvserve.secret_free": "yes",
                                  "kvserve.bytes": 1024}
    # Client span -> server span, across the call, for the OK and the failed one.
    clients = [s for s in by_name["grpc.health.v1.Health/Check"] if s["kind"] == 3]
    servers = [s for s in by_name["grpc.health.v1.Health/Check"] if s["kind"] == 2]
    assert len(clients) == len(servers) == 2
    assert {c["parent_span_id"] for c in clients} == {work["span_id"], root["span_id"]}
    assert {s["parent_span_id"] for s in servers} == {c["span_id"] for c in clients}
    codes = sorted(c["attributes"]["rpc.grpc.status_code"] for c in clients)
    assert codes == ["NOT_FOUND", "OK"]
    failed = next(c for c in clients if c["attributes"]["rpc.grpc.status_code"] == "NOT_FOUND")
    assert failed["status"] == 2                             # STATUS_CODE_ERROR
