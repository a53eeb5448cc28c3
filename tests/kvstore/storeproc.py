"""Helpers for tests that run the store as a real process (``kvserve store serve``)
or a real in-process gRPC server, and a few shared builders."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.config import HitRule, TierConfig, TrafficClasses
from kvserve.children import die_with_parent
from kvstore.warehouse import WarehouseConfig
from tests.redis_args import redis_args

LAYOUT = "L2xH2xT4xD8:float32"          # 2*2*2*4*8*4 = 1,024 bytes per block
BLOCK_BYTES = 1024
TEST_CLASSES = TrafficClasses(ttl_s={"agent": 3 * 86_400, "chat": 7 * 86_400, "fast": 2})


def blocks(n: int, seed: int = 0, nbytes: int = BLOCK_BYTES) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()) for _ in range(n)]


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(10_000 + seed)
    return [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(n)]


def wh_config(redis_url: str, g3: Path | None = None, *, g2_bytes: int = 1 << 20,
              g4: str = "", node: str = "n1", block_tokens: int = 4,
              hit_rule: HitRule | None = None) -> WarehouseConfig:
    return WarehouseConfig(
        redis_url=redis_url,
        tiers=TierConfig(g2_bytes=g2_bytes, g3_path=str(g3) if g3 else "", g3_bytes=1 << 30,
                         g4_url=g4, node=node),
        classes=TEST_CLASSES, hit_rule=hit_rule or HitRule(block_tokens=block_tokens),
        sweep_interval_s=0, fsync=False)


def write_config(path: Path, *, block_tokens: int = 4) -> Path:
    path.write_text(
        f"[blocks]\nblock_tokens = {block_tokens}\n"
        "[classes]\ndefault = \"chat\"\n"
        "[classes.ttl_s]\nagent = 259200\nchat = 604800\nfast = 2\n")
    return path


@dataclass
class StoreProc:
    """A ``kvserve store serve`` child process."""

    proc: subprocess.Popen[str]
    port: int
    args: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, redis_url: str, g3: Path | None, *, node: str = "n1",
              g2_bytes: str = "4MiB", config: Path | None = None,
              extra: Sequence[str] = (), timeout_s: float = 30.0) -> StoreProc:
        args = [sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
                "--port", "0", "--metrics-port", "-1", *redis_args(redis_url), "--node", node,
                "--g2-bytes", g2_bytes, "--no-prefault", "--grace", "5", *extra]
        if g3 is not None:
            args += ["--g3-path", str(g3)]
        if config is not None:
            args += ["--config", str(config)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=die_with_parent)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                line = proc.stdout.readline()
                if line.startswith("kvstore ready"):
                    port = int(line.split()[2].rsplit(":", 1)[1])
                    return cls(proc, port, args)
                if not line and proc.poll() is not None:
                    break
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"store did not start (last line {line!r}): {err[-2000:]}")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM: the store drains (flushes queued disk writes) and exits."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._close_pipes()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
