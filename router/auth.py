"""API keys and traffic classes: who is asking, and how long their KV lives.

``--api-key-file`` names a file of ``key tenant`` lines (``#`` comments and
blank lines allowed). With such a file every request needs a listed key as
``Authorization: Bearer KEY`` and its tenant comes from the key; without one,
every request belongs to the default tenant. The tenant salts block keys, so
two tenants never share cached KV. The traffic class comes from the
``X-KV-Class`` header and must be one the deployment configures.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, TrafficClasses
from router.errors import AuthenticationError, InvalidRequestError
from security.redact import register_secret
from security.secret_files import SecretFileError, read_secret_text, refuse_placeholder

DEFAULT_TENANT = "default"
CLASS_HEADER = "X-KV-Class"
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_KEY = re.compile(r"^\S{8,512}$")


class ApiKeyFileError(ConfigError):
    """The key file is unreadable or malformed; the message names the line."""


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    traffic_class: str
    # Which API key (its position in the key file, never the key): the admission
    # layer's rate and concurrency limits are per key. "" without keys.
    key_id: str = ""


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Key -> tenant. An empty table means authentication is off."""

    tenants: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, tenant in self.tenants.items():
            if not _KEY.match(key):
                raise ApiKeyFileError("API keys must be 8..512 non-space characters")
            if not _TENANT.match(tenant):
                raise ApiKeyFileError(f"tenant {tenant!r} must match [A-Za-z0-9._-]{{1,64}}")

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        p = Path(path)
        try:
            # Not world-readable; placeholders are checked per key below.
            text = read_secret_text(p, "the API key file", whole_value=False)
        except SecretFileError as exc:
            raise ApiKeyFileError(str(exc)) from exc
        tenants: dict[str, str] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ApiKeyFileError(f"{p}:{lineno}: want 'KEY TENANT', got {len(parts)} fields")
            key, tenant = parts
            if key in tenants:
                raise ApiKeyFileError(f"{p}:{lineno}: key listed twice")
            if not _KEY.match(key) or not _TENANT.match(tenant):
                raise ApiKeyFileError(f"{p}:{lineno}: key must be 8..512 non-space characters "
                                      "and tenant [A-Za-z0-9._-]{1,64}")
            try:
                refuse_placeholder(key, f"the API key on {p}:{lineno}")
            except SecretFileError as exc:
                raise ApiKeyFileError(str(exc)) from exc
            register_secret(key)
            tenants[key] = tenant
        if not tenants:
            raise ApiKeyFileError(f"API key file {p} lists no keys")
        return cls(tenants)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization`` header value, or AuthenticationError."""
        return self.resolve(authorization)[0]

    def resolve(self, authorization: str | None) -> tuple[str, str]:
        """(tenant, key id) of an ``Authorization`` header value, or AuthenticationError."""
        if not self.enabled:
            return DEFAULT_TENANT, ""
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer KEY'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("malformed Authorization header: want 'Bearer KEY'")
        key = key.strip()
        # Compare against every key in constant time so timing says nothing about prefixes.
        found, key_id = "", ""
        for i, (known, tenant) in enumerate(self.tenants.items()):
            if hmac.compare_digest(known.encode(), key.encode()):
                found, key_id = tenant, f"key-{i}"
        if not found:
            raise AuthenticationError("invalid API key")
        return found, key_id


def traffic_class(header: str | None, classes: TrafficClasses) -> str:
    """The request's traffic class from ``X-KV-Class``; unknown names are a 400."""
    name = (header or "").strip().lower()
    if name and name not in classes.ttl_s:
        raise InvalidRequestError(
            f"unknown traffic class {name!r} in {CLASS_HEADER}; known: {sorted(classes.ttl_s)}",
            param=CLASS_HEADER, code="unknown_traffic_class")
    return classes.resolve(name)


def identify(headers: Mapping[str, str], keys: ApiKeys, classes: TrafficClasses) -> Caller:
    """Tenant and class of a request from its headers (auth first: 401 beats 400)."""
    tenant, key_id = keys.resolve(headers.get("Authorization"))
    return Caller(tenant=tenant, traffic_class=traffic_class(headers.get(CLASS_HEADER), classes),
                  key_id=key_id)
