"""HTTPS with the deployment's CA, for the hops that are HTTP rather than gRPC
(the router and tools to vLLM's OpenAI servers).

Server side, vLLM's own flags do it (``--ssl-certfile/--ssl-keyfile`` of its
identity, ``--ssl-ca-certs`` = the deployment CA, ``--ssl-cert-reqs 2``: a
client without a certificate of this CA is refused in the handshake).

Client side, ``client_context`` presents this process's certificate and trusts
only the deployment CA. Callers that dial an address from the registry also
verify the server's role name (``server_name("engine")``, i.e.
``engine.kvserve.internal``) rather than the address, as the gRPC clients do.
"""

from __future__ import annotations

import ssl

from security.config import SecurityConfig, resolve_cert_dir
from security.pki import TLS_CERT, TLS_KEY, server_name

ENGINE_SERVER_NAME = server_name("engine")
CERT_REQUIRED = int(ssl.CERT_REQUIRED)


def client_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """TLS 1.2+ with this identity's certificate; None in plain text."""
    if security.insecure:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=security.ca_pem.decode())
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    d = resolve_cert_dir(security.cert_dir, security.role)
    ctx.load_cert_chain(str(d / TLS_CERT), str(d / TLS_KEY))
    return ctx


def server_args(identity_dir: str) -> list[str]:
    """vLLM ``serve`` flags for HTTPS with client certificates required."""
    from pathlib import Path

    from security.pki import CA_CERT

    d = Path(identity_dir)
    return ["--ssl-certfile", str(d / TLS_CERT), "--ssl-keyfile", str(d / TLS_KEY),
            "--ssl-ca-certs", str(d / CA_CERT), "--ssl-cert-reqs", str(CERT_REQUIRED)]


__all__ = ["CERT_REQUIRED", "ENGINE_SERVER_NAME", "client_context", "server_args"]
