"""Compiled hot paths with bit-identical pure-Python fallbacks.

``native._blockhash`` (built by ``pip install`` from ``native/*.c``) holds a
BLAKE2b written from RFC 7693 and kvserve's block-key chain. The extension is
optional: when it failed to build, or when ``KVSERVE_NO_NATIVE=1`` is set,
``HAVE_NATIVE`` is False and callers use their hashlib fallback.

The chain hashes its per-block leaves in SIMD lanes where the CPU allows
(``hash_paths()``: "scalar", "avx2", "avx512"; all give identical bytes).
``HASH_PATH`` is the one used by default: the fastest, unless the environment
variable ``KVSERVE_HASH_PATH`` names another at import (a test and benchmark
hook; a name this CPU cannot run raises ``ValueError`` at import).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from array import array

    import numpy as np

# What the C side accepts through the buffer protocol (collections.abc.Buffer is 3.12+).
Buffer: TypeAlias = "bytes | bytearray | memoryview | array[int] | np.ndarray"

_ext: ModuleType | None = None
if os.environ.get("KVSERVE_NO_NATIVE", "") not in ("1", "true", "yes"):
    try:
        from native import _blockhash as _ext
    except ImportError:  # not built (no compiler at install time)
        _ext = None

HAVE_NATIVE: bool = _ext is not None


def hash_paths() -> tuple[str, ...]:
    """Leaf-hashing paths this CPU supports, slowest first (empty without the extension)."""
    return _ext.paths() if _ext is not None else ()  # type: ignore[no-any-return]


def _default_path() -> str | None:
    wanted = os.environ.get("KVSERVE_HASH_PATH", "")
    if _ext is None:
        return None
    if wanted and wanted not in hash_paths():
        raise ValueError(f"KVSERVE_HASH_PATH={wanted!r}: this CPU supports "
                         f"{', '.join(hash_paths())}")
    return wanted or hash_paths()[-1]


HASH_PATH: str | None = _default_path()


class NativeUnavailable(RuntimeError):
    """The C extension is not importable (not built, or KVSERVE_NO_NATIVE=1)."""


def _require() -> ModuleType:
    if _ext is None:
        reason = ("KVSERVE_NO_NATIVE is set" if os.environ.get("KVSERVE_NO_NATIVE")
                  else "native._blockhash was not built")
        raise NativeUnavailable(f"native extension unavailable: {reason}")
    return _ext


def chain(tokens: Buffer, block_tokens: int, root: bytes, person: bytes, *,
          path: str | None = None) -> bytes:
    """Key chain over the full blocks of a little-endian uint32 token buffer.

    Returns ``n_full_blocks * 16`` bytes (key i at ``[16*i, 16*i+16)``).
    ``tokens`` may be bytes or any C-contiguous buffer of 4-byte unsigned
    integers (numpy uint32, ``array.array("I")``). The GIL is released while
    hashing, so several threads hash in parallel. ``path`` forces how leaves
    are hashed (one of ``hash_paths()``; default ``HASH_PATH``).
    """
    return _require().chain(  # type: ignore[no-any-return]
        tokens, block_tokens, root, person, path=path or HASH_PATH)


def chain_list(tokens: Buffer, block_tokens: int, root: bytes, person: bytes, *,
               path: str | None = None) -> list[bytes]:
    """``chain`` split into one 16-byte ``bytes`` per full block (built in C)."""
    return _require().chain_list(  # type: ignore[no-any-return]
        tokens, block_tokens, root, person, path=path or HASH_PATH)


def blake2b(data: Buffer, *, digest_size: int = 64, key: bytes = b"", salt: bytes = b"",
            person: bytes = b"") -> bytes:
    """One-shot BLAKE2b with hashlib's parameter semantics (for tests and benches)."""
    return _require().blake2b(  # type: ignore[no-any-return]
        data, digest_size=digest_size, key=key, salt=salt, person=person)


__all__ = ["HASH_PATH", "HAVE_NATIVE", "Buffer", "NativeUnavailable", "blake2b", "chain",
           "chain_list", "hash_paths"]
