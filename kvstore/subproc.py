"""Stopping the server processes kvstore starts (Redis, a Redis Cluster's nodes,
test servers): SIGTERM, a bounded wait, then SIGKILL, so a stop never hangs."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    """Terminate ``proc`` (already-exited is fine) and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
