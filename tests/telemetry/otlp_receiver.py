"""A minimal OTLP/gRPC trace receiver, run as its own process:

    python -m tests.telemetry.otlp_receiver --out spans.jsonl

It serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on a
free loopback port, prints ``OTLP_RECEIVER <port>`` once listening, and appends
every span it receives as one JSON line (ids in hex, the exporting service's
``service.name``, attributes as plain values) to ``--out`` (created 0600).
SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value",
                                        "double_value") else str(v)


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out: Path) -> None:
        self._out = out
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        lines = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    lines.append(json.dumps({
                        "service": res.get("service.name", ""),
                        "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                        "parent_span_id": sp.parent_span_id.hex(), "name": sp.name,
                        "kind": sp.kind, "start_ns": sp.start_time_unix_nano,
                        "end_ns": sp.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in sp.attributes},
                        "status": sp.status.code}))
        with self._lock, self._out.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.touch(mode=0o600)
    os.chmod(out, 0o600)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Receiver(out), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"OTLP_RECEIVER {port}", flush=True)
    stop.wait()
    server.stop(2).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
