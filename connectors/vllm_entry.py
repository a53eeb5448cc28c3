"""A vLLM instance's registry entry: what the router needs to place requests on
it, signed by the instance's own identity (``security.attest``).

Used by the connector (a vLLM server with ``KVServeConnector``) and by
``kvserve vllm-attach`` (a plain vLLM server, no connector). The entry names:

* ``address``: the OpenAI base URL the router posts to (https with kvserve's
  TLS; the router verifies the server's certificate names ``engine``);
* ``kv_events``: vLLM's own KV-event ZMQ endpoint (``--kv-events-config``),
  which the router subscribes to (``router.vllm_events``); a bind address
  (``tcp://*:5557``) is advertised with the host of ``address``;
* ``attestation``: the signature of the identity the entry names (its
  certificate's common name must equal ``instance_id``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from kvstore.registry import InstanceInfo
from security.attest import SignedFields, sign
from security.config import SecurityConfig, resolve_cert_dir
from security.pki import TLS_CERT, TLS_KEY

SIGNER_ROLE = "engine"


def events_endpoint(kv_events_config: Any, advertise: str) -> str:
    """The endpoint a subscriber connects to, or "" when vLLM publishes no events."""
    if kv_events_config is None or not getattr(kv_events_config, "enable_kv_cache_events",
                                               False):
        return ""
    if getattr(kv_events_config, "publisher", "zmq") != "zmq":
        return ""
    endpoint = str(getattr(kv_events_config, "endpoint", "") or "")
    host = urlsplit(advertise).hostname or "127.0.0.1"
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


def signed_fields(info: InstanceInfo) -> SignedFields:
    return SignedFields(info.instance_id, info.role, info.address, info.node,
                        info.model_fingerprint, info.kv_events)


def attested(info: InstanceInfo, security: SecurityConfig) -> InstanceInfo:
    """``info`` with its attestation (plain text: unsigned, as --insecure means)."""
    if security.insecure:
        return info
    d = resolve_cert_dir(security.cert_dir, SIGNER_ROLE)
    token = sign(signed_fields(info), (d / TLS_CERT).read_bytes(), (d / TLS_KEY).read_bytes())
    return dataclasses.replace(info, attestation=token)
