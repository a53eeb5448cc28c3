"""What kvserve's router and its vLLM instances prove to each other.

vLLM's OpenAI server takes ``cache_salt`` as free text from any client, and a
vLLM client cannot be told apart from kvserve's router by what it sends. So the
connector never takes a tenant from a salt's text: the router sends a salt that
*proves* the tenant, and everything else is an untrusted salt.

* ``tenant_salt(tenant, secret, nonce)``: ``kvs1.<tenant>.<nonce>.<mac>``, the
  MAC a BLAKE2b-128 of (tenant, nonce) keyed by a key derived from the deployment
  secret. Only holders of the secret (the router, operators) can mint one. The
  router uses one fixed nonce per tenant, so vLLM's own prefix cache, which keys
  blocks by the salt string, still shares a tenant's blocks between its requests;
  another nonce names the same tenant with a cold vLLM-local cache (tests and
  operators use that to reach the warehouse past vLLM's own cache).
* ``salt_scope(salt, secret)``: the tenant a salt proves, or, for any salt that
  proves nothing (no salt, a tenant's bare name, a forged or truncated MAC), the
  one untrusted namespace ``UNTRUSTED_TENANT`` with the salt itself as
  ``isolation``: the connector folds it into the block identity, so distinct
  untrusted salts still never share a block (vLLM's own semantics), the tenant
  table does not grow with every salt a client invents, and no untrusted salt
  ever reaches a real tenant's blocks.
* ``tenant_tag(tenant, secret)``: what kvserve's own KV-event publisher puts in
  vLLM's ``extra_keys`` slot for the salt: per tenant, keyed, and no credential.
* ``vllm_api_key(secret)``: the per-deployment API key of kvserve's vLLM servers
  (vLLM's ``--api-key``, handed over in ``VLLM_API_KEY``, never argv), derived
  from the deployment secret so no further secret has to be distributed.

With ``--insecure`` the secret is empty: anyone can then mint a salt, which is
what plain-text mode means (it says so in the log).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import NamedTuple

SALT_VERSION = "kvs1"
UNTRUSTED_TENANT = "vllm-untrusted"
DEFAULT_NONCE = "r"                      # the router's: one stable salt per tenant
MAC_BYTES = 16
_NONCE_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}\Z")
_TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
_SALT_KEY_LABEL = b"kvserve-vllm-salt-v1"
_API_KEY_LABEL = b"kvserve-vllm-api-key-v1"
_TAG_LABEL = b"kvserve-tenant-tag-v1"


class SaltScope(NamedTuple):
    """Whose blocks a request may touch: ``tenant``; ``isolation`` is "" for a
    proven tenant, else the untrusted salt that must be folded into the keys."""

    tenant: str
    trusted: bool
    isolation: str = ""


def _derive(secret: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=secret, digest_size=32).digest() if secret else label


def _mac(tenant: str, nonce: str, secret: bytes) -> str:
    return hashlib.blake2b(f"{tenant}\x00{nonce}".encode(), key=_derive(secret, _SALT_KEY_LABEL),
                           digest_size=MAC_BYTES).hexdigest()


def tenant_salt(tenant: str, secret: bytes, nonce: str = DEFAULT_NONCE) -> str:
    """The ``cache_salt`` that proves ``tenant`` to kvserve's vLLM connector."""
    if not _TENANT_RE.match(tenant):
        raise ValueError(f"tenant {tenant[:80]!r} must match [A-Za-z0-9._-]{{1,64}}")
    if not _NONCE_RE.match(nonce):
        raise ValueError(f"nonce {nonce[:40]!r} must match [A-Za-z0-9_-]{{1,32}}")
    return f"{SALT_VERSION}.{tenant}.{nonce}.{_mac(tenant, nonce, secret)}"


def salt_scope(salt: str | None, secret: bytes) -> SaltScope:
    """The tenant ``salt`` proves; anything else is the untrusted namespace."""
    text = salt or ""
    parts = text.split(".")
    # Tenant names may hold dots: version first, nonce and MAC last.
    if len(parts) >= 4 and parts[0] == SALT_VERSION:
        tenant, nonce, mac = ".".join(parts[1:-2]), parts[-2], parts[-1]
        if (_TENANT_RE.match(tenant) and _NONCE_RE.match(nonce)
                and len(mac) == 2 * MAC_BYTES
                and hmac.compare_digest(mac, _mac(tenant, nonce, secret))):
            return SaltScope(tenant, True)
    return SaltScope(UNTRUSTED_TENANT, False, text)


def untrusted_fingerprint(fingerprint: bytes, isolation: str) -> bytes:
    """The block identity of an untrusted salt: the model fingerprint with the salt
    folded in, so two untrusted salts (or one and a real tenant) share no key."""
    h = hashlib.blake2b(digest_size=len(fingerprint))
    h.update(b"kvserve-untrusted-salt-v1\x00" + fingerprint + b"\x00")
    h.update(isolation.encode("utf-8", "surrogatepass"))
    return h.digest()


def tenant_tag(tenant: str, secret: bytes) -> str:
    """A tenant's public tag for published KV events: stable, keyed (names nobody
    without the secret), and unlike the salt no credential (it mints nothing)."""
    return "kvs-tag." + hashlib.blake2b(tenant.encode(), key=_derive(secret, _TAG_LABEL),
                                        digest_size=12).hexdigest()


def vllm_api_key(secret: bytes) -> str:
    """The deployment's API key for its vLLM servers ("" with no secret: --insecure)."""
    if not secret:
        return ""
    return hashlib.blake2b(_API_KEY_LABEL, key=secret, digest_size=24).hexdigest()


__all__ = ["DEFAULT_NONCE", "UNTRUSTED_TENANT", "SaltScope", "salt_scope", "tenant_salt",
           "tenant_tag", "untrusted_fingerprint", "vllm_api_key"]
