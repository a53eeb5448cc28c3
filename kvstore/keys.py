"""Block keys: the 128-bit keyed chain everything in kvserve is indexed by
(docs/architecture.md#block-identity).

Definition (docs/block-keys.md has the reasoning)::

    tenant_salt = BLAKE2b-256(key=secret, b"kvserve-tenant-v1" + tenant)
    person      = BLAKE2b-128(key=tenant_salt, b"kvserve-person-v2" + fingerprint)
    h[-1]       = BLAKE2b-128(person=person, b"kvserve-root-v2")
    leaf[i]     = BLAKE2b-256(person=person, tokens[i*B:(i+1)*B] as <u4)
    h[i]        = BLAKE2b-128(salt=h[i-1], person=person, leaf[i])

Only full blocks get keys. Leaves are independent, so the C extension hashes
several at once in SIMD lanes; the sequential part is one compression per
block. The previous key and the tenant/model identity ride in BLAKE2b's
parameter block. ``chain_keys`` uses the C extension (``native``) when it is
importable and the hashlib loops otherwise; both give identical bytes.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import numpy as np

import native

KEY_BYTES = 16
FINGERPRINT_BYTES = 16
MAX_SECRET_BYTES = 64
MAX_BLOCK_TOKENS = 1 << 20
DEFAULT_TENANT = "default"
TENANT_RULE = "[A-Za-z0-9._-]{1,64}"

_TENANT_RE = re.compile(rf"^{TENANT_RULE}\Z")
_TENANT_TAG = b"kvserve-tenant-v1"
_PERSON_TAG = b"kvserve-person-v2"  # v2: two-level chain (leaf, then key)
_ROOT_TAG = b"kvserve-root-v2"
LEAF_BYTES = 32
_U32_LIMIT = 1 << 32
_U32_CODE = next((c for c in "IL" if array(c).itemsize == 4), "")

TokenInput = Sequence[int] | np.ndarray | array


class KeyInputError(ValueError):
    """Bad input to the key chain (tenant, fingerprint, secret, tokens, block size)."""


def validate_tenant(tenant: str) -> str:
    """The canonical tenant name: "" becomes "default"; anything else must match the rule."""
    if not isinstance(tenant, str):
        raise KeyInputError(f"tenant must be a str, got {type(tenant).__name__}")
    if tenant == "":
        return DEFAULT_TENANT
    if not _TENANT_RE.match(tenant):
        raise KeyInputError(f"tenant {tenant[:80]!r} must match {TENANT_RULE}")
    return tenant


def _check_bytes(value: object, what: str, *, exact: int | None = None,
                 limit: int | None = None) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise KeyInputError(f"{what} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if exact is not None and len(value) != exact:
        raise KeyInputError(f"{what} must be {exact} bytes, got {len(value)}")
    if limit is not None and len(value) > limit:
        raise KeyInputError(f"{what} must be at most {limit} bytes, got {len(value)}")
    return value


def _salt(tenant: str, secret: bytes) -> bytes:
    return hashlib.blake2b(_TENANT_TAG + tenant.encode(), digest_size=32, key=secret).digest()


class ChainIdentity(NamedTuple):
    """What a (tenant, model, secret) contributes to every key: BLAKE2b's
    personalisation and the chain's starting value h[-1]."""

    person: bytes
    root: bytes


@lru_cache(maxsize=1024)
def _identity(tenant: str, fingerprint: bytes, secret: bytes) -> ChainIdentity:
    # Cached (validation included): a serving process sees few (tenant, model)
    # pairs, and this is 3 hashes plus checks that would otherwise cost ~15% of
    # hashing an 8k-token prompt.
    tenant = validate_tenant(tenant)
    _check_bytes(fingerprint, "fingerprint", exact=FINGERPRINT_BYTES)
    _check_bytes(secret, "secret", limit=MAX_SECRET_BYTES)
    person = hashlib.blake2b(_PERSON_TAG + fingerprint, digest_size=KEY_BYTES,
                             key=_salt(tenant, secret)).digest()
    return ChainIdentity(person, root_key(person))


def chain_identity(tenant: str, fingerprint: bytes, secret: bytes = b"") -> ChainIdentity:
    """Validated, cached (person, root) for a tenant and model fingerprint."""
    if type(fingerprint) is not bytes:
        fingerprint = _check_bytes(fingerprint, "fingerprint", exact=FINGERPRINT_BYTES)
    if type(secret) is not bytes:
        secret = _check_bytes(secret, "secret", limit=MAX_SECRET_BYTES)
    if type(tenant) is not str:
        validate_tenant(tenant)  # raises with the type in the message
    return _identity(tenant, fingerprint, secret)


def tenant_salt(tenant: str, secret: bytes = b"") -> bytes:
    """32-byte per-tenant salt; keyed by the deployment secret when there is one."""
    tenant = validate_tenant(tenant)
    return _salt(tenant, _check_bytes(secret, "secret", limit=MAX_SECRET_BYTES))


def tenant_person(tenant: str, fingerprint: bytes, secret: bytes = b"") -> bytes:
    """The 16-byte BLAKE2b personalisation that every key of (tenant, model) carries."""
    return chain_identity(tenant, fingerprint, secret).person


def root_key(person: bytes) -> bytes:
    """h[-1]: the chain's starting value, a constant per (tenant, model)."""
    return hashlib.blake2b(_ROOT_TAG, digest_size=KEY_BYTES, person=person).digest()


def token_buffer(tokens: TokenInput) -> np.ndarray:
    """Tokens as a C-contiguous little-endian uint32 array, range-checked.

    A uint32 (or little-endian <u4) array passes through without a copy.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, array):
        arr = np.frombuffer(tokens, dtype=np.dtype(tokens.typecode)) if tokens else np.empty(0)
    elif isinstance(tokens, list | tuple) and _U32_CODE:
        # array("I") converts and range-checks a list ~4x faster than numpy does.
        try:
            arr = np.frombuffer(array(_U32_CODE, tokens), dtype=np.uint32)
        except (OverflowError, TypeError):
            bad = next((t for t in tokens if not isinstance(t, int | np.integer)
                        or not 0 <= int(t) < _U32_LIMIT), None)
            raise KeyInputError(f"token id {bad!r} invalid: ids must be integers with "
                                "0 <= t < 2**32") from None
    else:
        try:
            arr = np.asarray(tokens)
        except (OverflowError, ValueError) as exc:
            raise KeyInputError(f"tokens must be integers in [0, 2**32): {exc}") from None
    if arr.ndim != 1:
        raise KeyInputError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    kind = arr.dtype.kind
    if kind == "u" and arr.dtype.itemsize <= 4:
        pass  # every value fits
    elif kind in "iu":
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= _U32_LIMIT:
            bad = lo if lo < 0 else hi
            raise KeyInputError(f"token id {bad} out of range: ids must be 0 <= t < 2**32")
    elif kind == "O":
        for t in arr:
            if not isinstance(t, int | np.integer) or not 0 <= int(t) < _U32_LIMIT:
                raise KeyInputError(f"token id {t!r} out of range: ids must be 0 <= t < 2**32")
        arr = arr.astype(np.uint64)
    else:
        raise KeyInputError(f"tokens must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<u4")


def _check_block_tokens(block_tokens: int) -> int:
    if not isinstance(block_tokens, int) or not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
        raise KeyInputError(f"block_tokens must be an int in 1..{MAX_BLOCK_TOKENS}, "
                            f"got {block_tokens!r}")
    return block_tokens


def _prepare(tokens: TokenInput, block_tokens: int, tenant: str, fingerprint: bytes,
             secret: bytes) -> tuple[np.ndarray, ChainIdentity]:
    buf = token_buffer(tokens)
    _check_block_tokens(block_tokens)
    return buf, chain_identity(tenant, fingerprint, secret)


def chain_keys_py(tokens: TokenInput, *, block_tokens: int, tenant: str, fingerprint: bytes,
                  secret: bytes = b"") -> list[bytes]:
    """The hashlib fallback: one ``blake2b`` call per leaf, one per key."""
    buf, (person, prev) = _prepare(tokens, block_tokens, tenant, fingerprint, secret)
    data = memoryview(buf).cast("B")
    step = block_tokens * 4
    blake2b = hashlib.blake2b
    leaves = [blake2b(data[start:start + step], digest_size=LEAF_BYTES, person=person).digest()
              for start in range(0, (len(data) // step) * step, step)]
    keys: list[bytes] = []
    for leaf in leaves:
        prev = blake2b(leaf, digest_size=KEY_BYTES, salt=prev, person=person).digest()
        keys.append(prev)
    return keys


def chain_keys_native(tokens: TokenInput, *, block_tokens: int, tenant: str,
                      fingerprint: bytes, secret: bytes = b"",
                      path: str | None = None) -> list[bytes]:
    """The C chain (raises ``native.NativeUnavailable`` when it is not built).

    ``path`` forces a leaf-hashing path (``native.hash_paths()``), for tests and benches.
    """
    buf, (person, root) = _prepare(tokens, block_tokens, tenant, fingerprint, secret)
    return native.chain_list(buf, block_tokens, root, person, path=path)


def extend_chain(prev: bytes, tokens: TokenInput, *, block_tokens: int,
                 person: bytes) -> list[bytes]:
    """Keys of the full blocks of ``tokens`` continuing a chain whose last key is
    ``prev`` (``root_key(person)`` for none): the keys those blocks get inside
    the whole sequence. For consumers that learn a sequence block by block
    (vLLM's KV events carry each block's tokens and its parent)."""
    buf = token_buffer(tokens)
    _check_block_tokens(block_tokens)
    prev = _check_bytes(prev, "prev", exact=KEY_BYTES)
    person = _check_bytes(person, "person", exact=KEY_BYTES)
    if native.HAVE_NATIVE:
        return native.chain_list(buf, block_tokens, prev, person)
    data = memoryview(buf).cast("B")
    step = block_tokens * 4
    keys: list[bytes] = []
    for start in range(0, (len(data) // step) * step, step):
        leaf = hashlib.blake2b(data[start:start + step], digest_size=LEAF_BYTES,
                               person=person).digest()
        prev = hashlib.blake2b(leaf, digest_size=KEY_BYTES, salt=prev, person=person).digest()
        keys.append(prev)
    return keys


def chain_keys(tokens: TokenInput, *, block_tokens: int, tenant: str, fingerprint: bytes,
               secret: bytes = b"") -> list[bytes]:
    """One 16-byte key per FULL block of ``tokens`` (native when available)."""
    impl = chain_keys_native if native.HAVE_NATIVE else chain_keys_py
    return impl(tokens, block_tokens=block_tokens, tenant=tenant, fingerprint=fingerprint,
                secret=secret)


__all__ = [
    "DEFAULT_TENANT",
    "FINGERPRINT_BYTES",
    "KEY_BYTES",
    "LEAF_BYTES",
    "MAX_SECRET_BYTES",
    "TENANT_RULE",
    "ChainIdentity",
    "KeyInputError",
    "chain_identity",
    "chain_keys",
    "chain_keys_native",
    "chain_keys_py",
    "extend_chain",
    "root_key",
    "tenant_person",
    "tenant_salt",
    "token_buffer",
    "validate_tenant",
]
