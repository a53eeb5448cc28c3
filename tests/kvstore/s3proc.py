"""A real S3 API on loopback: moto's standalone ``moto_server`` (the S3 HTTP
protocol; s3fs's own test suite runs against it), for the G4 tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvstore.redis_server import free_port
from kvstore.subproc import stop_process

ACCESS = {"key": "kvserve-test", "secret": "kvserve-test-secret"}


@dataclass(slots=True)
class MotoS3:
    port: int = 0
    host: str = "127.0.0.1"
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, **ACCESS}

    def start(self, timeout_s: float = 30.0) -> MotoS3:
        self.port = self.port or free_port(self.host)
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable))
        if exe is None:
            raise FileNotFoundError("moto_server not installed: pip install 'moto[server]'")
        self._proc = subprocess.Popen([exe, "-H", self.host, "-p", str(self.port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, OSError):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, **ACCESS, skip_instance_cache=True)
        fs.mkdir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        stop_process(self._proc)
        self._proc = None

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
