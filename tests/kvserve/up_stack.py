"""One ``kvserve up --model tiny-dense`` for test_up.py and test_up_secrets.py
(a start is ~15 s of CPU here): as a new user runs it, with no credentials in
the environment (``up`` makes the stack's own), its own embedded Redis, and
the state under a directory of its own. Started when a test first asks for it;
test_up_secrets.py's last test stops it with Ctrl-C (and checks the stop), and
a test after that gets a fresh one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CREDENTIAL_VARS = ("REDIS_URL", "REDIS_URL_FILE", "KVSERVE_TLS_DIR", "KVSERVE_SECRET_FILE",
                   "KVSERVE_API_KEY")


@dataclass
class UpStack:
    root: Path
    runs: int = 0
    proc: subprocess.Popen[str] | None = None
    banner: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tmp(self) -> Path:
        """The running stack's state directory (up.json, tls/, g3/)."""
        return self.root / f"run{self.runs}"

    @property
    def state(self) -> dict:  # type: ignore[type-arg]
        return json.loads((self.tmp / "up.json").read_text())  # type: ignore[no-any-return]

    def running(self) -> UpStack:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.runs += 1
        self.tmp.mkdir(parents=True)
        env = {**os.environ, "KVSERVE_STATE": str(self.tmp / "up.json")}
        for name in CREDENTIAL_VARS:
            env.pop(name, None)
        env["REDIS_URL_FILE"] = ""                 # an empty variable is "not set"
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "up", "--model", "tiny-dense", "--free-ports",
             "--grace", "5", "--g3-path", str(self.tmp / "g3")],
            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines: list[str] = []
        deadline = time.monotonic() + 180
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("  try:"):
                break
        self.banner = "".join(lines)
        assert "kvserve up: running" in self.banner, self.banner + (
            self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr
            else "")
        return self

    def interrupt(self) -> tuple[int, str, str]:
        """Ctrl-C: (exit status, rest of stdout, stderr)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, out, err

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
