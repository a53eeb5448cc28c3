"""Channels for tests that call servers directly: mTLS with the session's
deployment (tests/conftest.py ``tls_dir`` exports it), as an operator."""

from __future__ import annotations

import grpc

from security.config import SecurityConfig


def security(role: str = "operator") -> SecurityConfig:
    return SecurityConfig.from_env(role)


def channel(address: str, peer_role: str = "") -> grpc.Channel:
    return security().sync_channel(address, peer_role)


def aio_channel(address: str, peer_role: str = "") -> grpc.aio.Channel:
    return security().aio_channel(address, peer_role)


def secret() -> bytes:
    """The session deployment's secret: what the services key tenant salts with."""
    return security().require_secret()
