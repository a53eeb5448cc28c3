"""Block keys: the definition, tenant isolation, input checks, and the fallback alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest

from kvstore.keys import (
    KEY_BYTES,
    KeyInputError,
    chain_keys,
    chain_keys_py,
    tenant_person,
    validate_tenant,
)

FP = bytes.fromhex("00112233445566778899aabbccddeeff")
ROOT = Path(__file__).resolve().parents[2]


def reference_keys(tokens: list[int], block_tokens: int, tenant: str, fingerprint: bytes,
                   secret: bytes = b"") -> list[bytes]:
    """docs/block-keys.md, transcribed independently of kvstore.keys."""
    salt = hashlib.blake2b(b"kvserve-tenant-v1" + tenant.encode(), digest_size=32,
                           key=secret).digest()
    person = hashlib.blake2b(b"kvserve-person-v2" + fingerprint, digest_size=16,
                             key=salt).digest()
    prev = hashlib.blake2b(b"kvserve-root-v2", digest_size=16, person=person).digest()
    out = []
    for i in range(len(tokens) // block_tokens):
        block = b"".join(t.to_bytes(4, "little")
                         for t in tokens[i * block_tokens:(i + 1) * block_tokens])
        leaf = hashlib.blake2b(block, digest_size=32, person=person).digest()
        prev = hashlib.blake2b(leaf, digest_size=16, salt=prev, person=person).digest()
        out.append(prev)
    return out


def v1_keys(tokens: list[int], block_tokens: int, tenant: str, fingerprint: bytes) -> list[bytes]:
    """The previous definition (one hash per block over the tokens), for the version test."""
    salt = hashlib.blake2b(b"kvserve-tenant-v1" + tenant.encode(), digest_size=32).digest()
    person = hashlib.blake2b(b"kvserve-person-v1" + fingerprint, digest_size=16,
                             key=salt).digest()
    prev = hashlib.blake2b(b"kvserve-root-v1", digest_size=16, person=person).digest()
    out = []
    for i in range(len(tokens) // block_tokens):
        block = b"".join(t.to_bytes(4, "little")
                         for t in tokens[i * block_tokens:(i + 1) * block_tokens])
        prev = hashlib.blake2b(block, digest_size=16, salt=prev, person=person).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("secret", [b"", b"deployment-secret", bytes(64)])
@pytest.mark.parametrize("block_tokens", [1, 16, 32, 33, 64])
def test_keys_follow_the_documented_definition(secret: bytes, block_tokens: int) -> None:
    rng = np.random.default_rng(7)
    n_blocks = 19  # more than the widest SIMD group (8), not a multiple of it
    size = block_tokens * n_blocks + block_tokens // 2
    tokens = [int(t) for t in rng.integers(0, 2**32, size=size, dtype=np.uint64)]
    want = reference_keys(tokens, block_tokens, "acme", FP, secret)
    assert len(want) == n_blocks
    kw = dict(block_tokens=block_tokens, tenant="acme", fingerprint=FP, secret=secret)
    assert chain_keys_py(tokens, **kw) == want
    assert chain_keys(tokens, **kw) == want
    assert all(len(k) == KEY_BYTES for k in want)


def test_no_key_of_the_previous_definition_survives() -> None:
    tokens = list(range(64 * 8))
    old = set(v1_keys(tokens, 64, "t", FP))
    new = chain_keys(tokens, block_tokens=64, tenant="t", fingerprint=FP)
    assert len(old) == len(new) == 8
    assert not old & set(new)


def test_only_full_blocks_get_keys_and_prefixes_share_keys() -> None:
    tokens = list(range(64 * 3 + 63))
    keys = chain_keys(tokens, block_tokens=64, tenant="t", fingerprint=FP)
    assert len(keys) == 3
    assert chain_keys(tokens[:128], block_tokens=64, tenant="t", fingerprint=FP) == keys[:2]
    assert chain_keys(tokens[:63], block_tokens=64, tenant="t", fingerprint=FP) == []
    # A different first block changes every later key (the chain).
    changed = chain_keys([1, *tokens[1:]], block_tokens=64, tenant="t", fingerprint=FP)
    assert not set(changed) & set(keys)


def test_tenants_never_share_keys() -> None:
    tokens = np.arange(64 * 20, dtype=np.uint32)
    seen: dict[bytes, str] = {}
    for tenant in ("default", "acme", "acme2", "Acme", "a.b", "a_b"):
        for k in chain_keys(tokens, block_tokens=64, tenant=tenant, fingerprint=FP):
            assert k not in seen, f"{tenant} shares a key with {seen[k]}"
            seen[k] = tenant
    assert tenant_person("acme", FP) != tenant_person("acme", FP, b"other secret")


def test_fingerprint_changes_every_key() -> None:
    tokens = np.arange(64 * 10, dtype=np.uint32)
    a = chain_keys(tokens, block_tokens=64, tenant="t", fingerprint=FP)
    for i in range(16):
        fp = bytearray(FP)
        fp[i] ^= 1
        b = chain_keys(tokens, block_tokens=64, tenant="t", fingerprint=bytes(fp))
        assert all(x != y for x, y in zip(a, b, strict=True))


def test_empty_tenant_is_default() -> None:
    tokens = list(range(64))
    assert validate_tenant("") == "default"
    assert chain_keys(tokens, block_tokens=64, tenant="", fingerprint=FP) == \
        chain_keys(tokens, block_tokens=64, tenant="default", fingerprint=FP)


@pytest.mark.parametrize("tenant", ["a b", "x" * 65, "é", "a/b", "a\n"])
def test_bad_tenant_names_the_rule(tenant: str) -> None:
    with pytest.raises(KeyInputError, match=r"A-Za-z0-9\._-"):
        chain_keys([1, 2], block_tokens=1, tenant=tenant, fingerprint=FP)


@pytest.mark.parametrize("tokens", [[-1], [2**32], [2**64], [1.5], np.array([3.0]),
                                    np.array([[1, 2]]), np.array([-5], dtype=np.int8)])
def test_bad_tokens_are_rejected(tokens: object) -> None:
    with pytest.raises(KeyInputError):
        chain_keys(tokens, block_tokens=1, tenant="t", fingerprint=FP)  # type: ignore[arg-type]


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(KeyInputError, match="block_tokens"):
        chain_keys([1], block_tokens=0, tenant="t", fingerprint=FP)
    with pytest.raises(KeyInputError, match="fingerprint must be 16 bytes"):
        chain_keys([1], block_tokens=1, tenant="t", fingerprint=b"short")
    with pytest.raises(KeyInputError, match="secret must be at most 64"):
        chain_keys([1], block_tokens=1, tenant="t", fingerprint=FP, secret=bytes(65))


def test_input_kinds_agree() -> None:
    ids = [5, 2**32 - 1, 0, 77] * 32
    want = chain_keys(ids, block_tokens=16, tenant="t", fingerprint=FP)
    for tokens in (np.array(ids, dtype=np.int64), np.array(ids, dtype=np.uint32),
                   np.array(ids, dtype=">u4"), array("I", ids), array("q", ids), tuple(ids)):
        assert chain_keys(tokens, block_tokens=16, tenant="t", fingerprint=FP) == want


def test_package_works_without_the_extension() -> None:
    tokens = list(range(300))
    want = [k.hex() for k in reference_keys(tokens, 64, "t", FP)]
    code = (
        "import native\n"
        "from kvstore.keys import chain_keys\n"
        "assert not native.HAVE_NATIVE\n"
        f"keys = chain_keys(list(range(300)), block_tokens=64, tenant='t', fingerprint={FP!r})\n"
        "print(','.join(k.hex() for k in keys))\n"
    )
    env = {**os.environ, "KVSERVE_NO_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip().split(",") == want
