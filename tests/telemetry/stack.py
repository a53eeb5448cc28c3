"""A real ``kvserve up`` stack (tiny-dense model, free ports, its own state dir)
exporting traces to a real OTLP receiver process on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY = "sk-observe-test-0123456789"
TENANT = "acme-private-tenant"        # must never show up in a span


@dataclass
class Stack:
    state: dict[str, Any]
    spans_file: Path

    @property
    def http(self) -> str:
        return str(self.state["router_http"])

    def spans(self) -> list[dict[str, Any]]:
        text = self.spans_file.read_text()
        text = text[:text.rfind("\n") + 1]      # a line still being written waits
        return [json.loads(line) for line in text.splitlines() if line]


def _first_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} line; got:\n{''.join(seen)}")


def _stop(proc: subprocess.Popen[str], sig: int, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def traced_stack(tmp: Path) -> Iterator[Stack]:
    """The stack while the block runs; on leaving, the stack stops first (each
    process flushes its spans as it exits), then the receiver."""
    spans = tmp / "spans.jsonl"
    receiver = subprocess.Popen([sys.executable, "-m", "tests.telemetry.otlp_receiver",
                                 "--out", str(spans)], stdout=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    up: subprocess.Popen[str] | None = None
    try:
        port = int(_first_line(receiver, "OTLP_RECEIVER ", 30).split()[1])
        keys = tmp / "keys.txt"
        keys.write_text(f"{API_KEY} {TENANT}\n")
        keys.chmod(0o600)
        env = {**os.environ,
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        for var in ("REDIS_URL", "KVSERVE_TLS_DIR", "KVSERVE_STATE", "OTEL_SDK_DISABLED",
                    "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            env.pop(var, None)
        up = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "up", "--model", "tiny-dense",
                               "--free-ports", "--state-dir", str(tmp / "state"), "--grace", "5",
                               "--g3-path", str(tmp / "g3"), "--api-key-file", str(keys)],
                              env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _first_line(up, "  try:", 240)
        state = json.loads((tmp / "state" / "up.json").read_text())
        yield Stack(state, spans)
    finally:
        if up is not None:
            _stop(up, signal.SIGINT, 60)
        _stop(receiver, signal.SIGTERM, 10)
