"""Who a vLLM request's KV belongs to: tenant, traffic class, model fingerprint.

* Tenant: only what vLLM's ``cache_salt`` *proves* (``security.vllm_trust``):
  kvserve's router sends a salt MAC'd under the deployment secret, and that
  tenant is used. Any other salt (a tenant's bare name, free text, a forged
  MAC, none) is the one untrusted namespace, with the salt folded into the
  block identity (``KVIdentity.fingerprint``): untrusted salts never share a
  block with each other nor with any real tenant, and none is rejected.
* Traffic class: ``kv_transfer_params["kv_class"]`` (the router copies its
  ``X-KV-Class`` header there), else the configured default.
* Fingerprint: BLAKE2b-128 of the weights' bytes, the dtype, the KV cache dtype,
  vLLM's KV layout (attention backend, per-layer block shape) and the block
  size. Our own engine hashes a different layout string, so its KV and vLLM's
  can never be served to each other, nor two vLLM layouts to each other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, TrafficClasses
from security.vllm_trust import salt_scope, untrusted_fingerprint

LAYOUT_VERSION = 1          # bump when the bytes a block holds change meaning
LAYOUT_TAG = "LBHNC"        # vLLM's per-layer blocks [kv_heads, tokens, K|V]
CLASS_PARAM = "kv_class"


class IdentityError(ValueError):
    """A request or model whose KV identity cannot be determined."""


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """The tenant a request acts for and the fingerprint its keys are chained with."""

    tenant: str
    fingerprint: bytes
    trusted: bool


def identity_of(cache_salt: str | None, fingerprint: bytes, secret: bytes) -> KVIdentity:
    """The request's KV identity from the salt it carries (module doc)."""
    scope = salt_scope(cache_salt, secret)
    if scope.trusted:
        return KVIdentity(scope.tenant, fingerprint, True)
    return KVIdentity(scope.tenant, untrusted_fingerprint(fingerprint, scope.isolation), False)


def traffic_class_of(params: Mapping[str, Any] | None, classes: TrafficClasses) -> str:
    """The request's class; an unknown name is an error (a typo must not pick a TTL)."""
    name = (params or {}).get(CLASS_PARAM) or ""
    if not isinstance(name, str):
        raise IdentityError(f"kv_transfer_params.{CLASS_PARAM} must be a string")
    try:
        return classes.resolve(name)
    except ConfigError as exc:
        raise IdentityError(str(exc)) from None


def weights_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
    if not files:
        raise IdentityError(f"{d}: no *.safetensors or *.bin weights to fingerprint")
    return files


def fingerprint(weights_id: bytes, *, dtype: str, cache_dtype: str, layout: str,
                block_tokens: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(weights_id)
    h.update(f"|vllm-kv{LAYOUT_VERSION}|{dtype}|{cache_dtype}|{layout}|B{block_tokens}".encode())
    return h.digest()


def vllm_fingerprint(model_dir: str | Path, *, dtype: str = "float32",
                     cache_dtype: str = "auto", block_tokens: int = 64) -> bytes:
    """What a connector serving ``model_dir`` computes (``kvserve vllm-attach`` uses it
    for a plain vLLM server, so both kinds map prompts to the same keys)."""
    return fingerprint(model_weights_id(model_dir), dtype=dtype, cache_dtype=cache_dtype,
                       layout=LAYOUT_TAG, block_tokens=block_tokens)


def model_weights_id(model_dir: str | Path) -> bytes:
    """The engine's cached weights hash (the same bytes give the same id)."""
    from engine.loader import weights_hash

    files = weights_files(model_dir)
    return weights_hash(files, files[0].parent)
