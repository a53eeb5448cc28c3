"""Registry entries that prove who wrote them.

The instance registry lives in Redis, and whoever can write Redis could list a
"prefill" instance at an address of their choosing and receive every tenant's
prompts. So an engine outside kvserve's own processes (a vLLM server with the
connector, or one registered by ``kvserve vllm-attach``) signs its entry with
its certificate's private key, and the router places requests only on entries
whose signature verifies:

* the certificate was issued by the deployment's CA and is within its validity;
* it names the role ``engine`` (``urn:kvserve:role:engine``), with no tenant scope;
* its common name equals the entry's ``instance_id`` (the entry is accepted only
  from the identity it names: ``kvserve certs issue DIR --role engine --name ID``);
* the ECDSA signature covers every field that decides where traffic goes
  (instance id, role, address, node, model fingerprint, KV event endpoint).

A copied genuine entry can only point at the genuine instance, whose TLS
certificate the router verifies again on every connection (the server name
``engine.kvserve.internal``). Load fields (heartbeats) are not signed: forging
them skews placement, never where a prompt goes.

Format: ``v1.<certificate DER, base64url>.<signature DER, base64url>``.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Sequence
from typing import NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from security.identity import identity_from_uris

VERSION = "v1"
SIGNER_ROLE = "engine"
_DOMAIN = b"kvserve-registry-entry-v1\x00"
MAX_ATTESTATION_CHARS = 8192


class AttestationError(ValueError):
    """An entry whose signature does not prove the identity it names."""


class SignedFields(NamedTuple):
    """What a signature covers (in this order)."""

    instance_id: str
    role: str
    address: str
    node: str
    model_fingerprint: str
    kv_events: str

    def message(self) -> bytes:
        for v in self:
            if "\x00" in v:
                raise AttestationError("registry field holds a NUL byte")
        return _DOMAIN + "\x00".join(self).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(fields: SignedFields, cert_pem: bytes, key_pem: bytes) -> str:
    """The attestation of ``fields`` by the identity in ``cert_pem``/``key_pem``."""
    key = serialization.load_pem_private_key(key_pem, None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise AttestationError("the identity's key is not an EC private key")
    cert = x509.load_pem_x509_certificate(cert_pem)
    sig = key.sign(fields.message(), ec.ECDSA(hashes.SHA256()))
    return ".".join((VERSION, _b64(cert.public_bytes(serialization.Encoding.DER)), _b64(sig)))


def verify(fields: SignedFields, attestation: str, ca_pem: bytes, *,
           roles: Sequence[str] = (SIGNER_ROLE,), now: dt.datetime | None = None) -> str:
    """The signer's name when ``attestation`` proves ``fields``; AttestationError otherwise."""
    if not attestation:
        raise AttestationError("entry is not signed")
    if len(attestation) > MAX_ATTESTATION_CHARS:
        raise AttestationError("attestation too long")
    parts = attestation.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise AttestationError("attestation is not v1.<cert>.<signature>")
    try:
        cert = x509.load_der_x509_certificate(_unb64(parts[1]))
        sig = _unb64(parts[2])
        ca = x509.load_pem_x509_certificate(ca_pem)
    except (ValueError, binascii.Error) as exc:
        raise AttestationError(f"unreadable attestation: {exc}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise AttestationError("certificate not issued by this deployment's CA") from None
    t = now or dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= t <= cert.not_valid_after_utc:
        raise AttestationError("certificate outside its validity period")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise AttestationError("certificate names no kvserve identity") from None
    ident = identity_from_uris(san.get_values_for_type(x509.UniformResourceIdentifier))
    if ident is None or ident.tenant or ident.role not in roles:
        raise AttestationError(f"certificate role is not one of {list(roles)}")
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(names[0].value) if names else ""
    if name != fields.instance_id:
        raise AttestationError(f"certificate names {name!r}, the entry {fields.instance_id!r}")
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise AttestationError("certificate key is not EC")
    try:
        public.verify(sig, fields.message(), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise AttestationError("signature does not match the entry") from None
    return name


__all__ = ["SIGNER_ROLE", "AttestationError", "SignedFields", "sign", "verify"]
