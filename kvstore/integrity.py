"""The key behind integrity at rest (docs/security.md, "Integrity at rest and quotas").

Every G3 file and G4 object carries a MAC over its header, which holds the
block key, tenant namespace, layout, size and the payload's checksum
(kvstore.blockfile). The MAC key is purpose-specific, derived from the
deployment secret and never the secret itself::

    block_mac_key = BLAKE2b-256(key=secret, "kvserve-block-mac-v1")

so a kvstore can be handed only this key (``--integrity-key-file``, written by
``kvserve store integrity-key``): it then verifies and tags blocks but cannot
compute any tenant's block keys, which need the secret (kvstore.keys).

Where the key comes from, first match wins: ``--integrity-key-file``, the file
named by ``KVSERVE_INTEGRITY_KEY_FILE``, else derived from the deployment
secret of the process's ``SecurityConfig``. Outside ``--insecure`` a store
with neither refuses to start; in plain-text mode without a secret the tag is
an unkeyed hash (damage is caught, forgery is not) and the store says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from kvstore.blockfile import MAC_KEY_BYTES, UNKEYED, BlockMac
from security.config import SecurityConfig, SecurityError

log = logging.getLogger(__name__)

INTEGRITY_KEY_ENV = "KVSERVE_INTEGRITY_KEY_FILE"
_TAG = b"kvserve-block-mac-v1"


def derive_mac_key(secret: bytes) -> bytes:
    """The 32-byte block MAC key of a deployment secret."""
    if not secret:
        raise SecurityError("no deployment secret to derive the block MAC key from")
    return hashlib.blake2b(_TAG, key=secret, digest_size=MAC_KEY_BYTES).digest()


def read_key_file(path: str | Path) -> bytes:
    """A key file: hex text of 32 bytes, readable by nobody but its owner (and a
    group, as Kubernetes mounts Secrets with ``defaultMode: 0440``)."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text().strip()
    except OSError as exc:
        raise SecurityError(f"cannot read the integrity key file {p}: "
                            f"{exc.strerror or exc}") from None
    if st.st_mode & stat.S_IROTH:
        raise SecurityError(f"integrity key file {p} is readable by every user "
                            f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != MAC_KEY_BYTES:
        raise SecurityError(f"integrity key file {p} must hold {MAC_KEY_BYTES} bytes as hex")
    return key


def write_key_file(path: str | Path, key: bytes) -> Path:
    """Write ``key`` as hex into a new file of mode 0600 (never over an existing one)."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return p


def block_mac(security: SecurityConfig | None, key_file: str = "") -> BlockMac:
    """The MAC a store tags and verifies its G3/G4 blocks with (see the module doc)."""
    path = key_file or os.environ.get(INTEGRITY_KEY_ENV, "")
    if path:
        return BlockMac(read_key_file(path))
    security = security or SecurityConfig.from_env("kvstore")
    secret = security.require_secret()   # raises outside --insecure when there is none
    if secret:
        return BlockMac(derive_mac_key(secret))
    log.warning("SECURITY: no deployment secret (--insecure): G3/G4 blocks carry an unkeyed "
                "tag that catches damage but not forgery; whoever can write the disk or "
                "bucket can plant blocks")
    return UNKEYED


__all__ = ["INTEGRITY_KEY_ENV", "block_mac", "derive_mac_key", "read_key_file",
           "write_key_file"]
