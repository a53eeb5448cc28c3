"""Who a caller is, as its certificate says (``security.pki`` writes these).

- ``role``: what the holder is. Service roles run kvserve's processes and may
  act for any tenant (they pass the tenant the router authenticated in the
  ``x-kvserve-tenant`` metadata); ``operator`` runs maintenance (Delete, sweeps);
  ``tenant`` is an outside client bound to one tenant.
- ``tenant``: an optional scope. A scoped identity only ever acts for that
  tenant, whatever its role and whatever the request or metadata claims.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROLES: tuple[str, ...] = ("kvstore", "prefill", "decode", "router", "engine", "operator",
                          "tenant")
# Roles whose processes serve gRPC and act for the tenants they were handed.
SERVICE_ROLES: frozenset[str] = frozenset({"kvstore", "prefill", "decode", "router", "engine"})
ROLE_PREFIX = "urn:kvserve:role:"
TENANT_PREFIX = "urn:kvserve:tenant:"
TENANT_METADATA = "x-kvserve-tenant"
_TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")


class IdentityError(ValueError):
    """A role or tenant scope that no certificate may carry."""


def validate_identity(role: str, tenant: str = "") -> None:
    if role not in ROLES:
        raise IdentityError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if tenant and not _TENANT_RE.match(tenant):
        raise IdentityError(f"tenant {tenant[:80]!r} must match [A-Za-z0-9._-]{{1,64}}")
    if role == "tenant" and not tenant:
        raise IdentityError("a tenant identity must name its tenant")


def role_uri(role: str) -> str:
    return ROLE_PREFIX + role


def tenant_uri(tenant: str) -> str:
    return TENANT_PREFIX + tenant


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller. ``insecure`` marks the one identity a
    plain-text server gives everyone (``--insecure``)."""

    role: str
    name: str = ""
    tenant: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        validate_identity(self.role, self.tenant)

    @property
    def is_service(self) -> bool:
        return self.role in SERVICE_ROLES and not self.tenant

    @property
    def is_operator(self) -> bool:
        return self.role == "operator" and not self.tenant

    def describe(self) -> str:
        scope = f" for tenant {self.tenant}" if self.tenant else ""
        return f"{self.role} {self.name!r}{scope}"


# Plain-text mode: no credentials exist, so every caller is trusted like a service
# and an operator (exactly today's behaviour, which is why it needs --insecure).
INSECURE = Identity("operator", "insecure", insecure=True)


def identity_from_uris(uris: list[str], name: str = "") -> Identity | None:
    """The identity named by a certificate's URI SANs; None when it names no
    role, two roles or two tenants (such a certificate is not ours)."""
    roles = [u[len(ROLE_PREFIX):] for u in uris if u.startswith(ROLE_PREFIX)]
    tenants = [u[len(TENANT_PREFIX):] for u in uris if u.startswith(TENANT_PREFIX)]
    if len(roles) != 1 or len(tenants) > 1:
        return None
    try:
        return Identity(roles[0], name, tenants[0] if tenants else "")
    except IdentityError:
        return None


__all__ = ["INSECURE", "ROLES", "SERVICE_ROLES", "TENANT_METADATA", "Identity",
           "IdentityError", "identity_from_uris", "role_uri", "tenant_uri",
           "validate_identity"]
