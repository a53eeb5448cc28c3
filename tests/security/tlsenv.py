"""mTLS for the issue-10 verification/input tests: the deployment directory the
suite uses (``KVSERVE_TLS_DIR``), or one made for this test when the suite runs
without one, and channels with its operator credentials."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest


@pytest.fixture()
def tls_env(tmp_path_factory: pytest.TempPathFactory,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """KVSERVE_TLS_DIR for in-process servers, clients and spawned children."""
    existing = os.environ.get("KVSERVE_TLS_DIR", "")
    if existing:
        yield existing
        return
    from security.pki import ensure_deployment

    root = ensure_deployment(tmp_path_factory.mktemp("tls"))
    monkeypatch.setenv("KVSERVE_TLS_DIR", str(root))
    yield str(root)


def aio_channel(address: str, peer_role: str,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An operator's channel to ``address`` (mTLS when the deployment has it)."""
    from security.config import SecurityConfig

    if not os.environ.get("KVSERVE_TLS_DIR"):
        return grpc.aio.insecure_channel(address, options=list(options))
    return SecurityConfig.from_env("operator").aio_channel(address, peer_role, list(options))


def certs_dir() -> Path:
    return Path(os.environ["KVSERVE_TLS_DIR"])
