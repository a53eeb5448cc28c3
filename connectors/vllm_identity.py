"""Who a vLLM request's KV belongs to: tenant, traffic class, model fingerprint.

* Tenant: vLLM's ``cache_salt`` (the router sends the caller's tenant there).
  A salt that is a valid kvserve tenant name is that tenant; any other salt
  (free text from some other client) becomes ``salt-<BLAKE2b-128 hex>``, so two
  salts never share a tenant and none is rejected. No salt: the default tenant.
* Traffic class: ``kv_transfer_params["kv_class"]`` (the router copies its
  ``X-KV-Class`` header there), else the configured default.
* Fingerprint: BLAKE2b-128 of the weights' bytes, the dtype, the KV cache dtype,
  vLLM's KV layout (attention backend, per-layer block shape) and the block
  size. Our own engine hashes a different layout string, so its KV and vLLM's
  can never be served to each other, nor two vLLM layouts to each other.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config import ConfigError, TrafficClasses
from kvstore.keys import DEFAULT_TENANT, TENANT_RULE

LAYOUT_VERSION = 1          # bump when the bytes a block holds change meaning
CLASS_PARAM = "kv_class"
_TENANT_RE = re.compile(rf"^{TENANT_RULE}\Z")


class IdentityError(ValueError):
    """A request or model whose KV identity cannot be determined."""


def tenant_of(cache_salt: str | None) -> str:
    if not cache_salt:
        return DEFAULT_TENANT
    if _TENANT_RE.match(cache_salt):
        return cache_salt
    return "salt-" + hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest()


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


def model_weights_id(model_dir: str | Path) -> bytes:
    """The engine's cached weights hash (the same bytes give the same id)."""
    from engine.loader import weights_hash

    files = weights_files(model_dir)
    return weights_hash(files, files[0].parent)
