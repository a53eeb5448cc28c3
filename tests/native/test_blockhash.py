"""native._blockhash: BLAKE2b from RFC 7693 against hashlib, the C chain
against the hashlib fallback, and every SIMD leaf path against scalar, bit for bit."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
from array import array
from pathlib import Path

import numpy as np
import pytest

import native
from kvstore.keys import chain_keys_native, chain_keys_py, root_key, tenant_person

pytestmark = pytest.mark.skipif(not native.HAVE_NATIVE, reason="native extension not built")

FP = bytes(range(16))
ROOT = Path(__file__).resolve().parents[2]
PATHS = native.hash_paths()
SIMD_PATHS = [p for p in PATHS if p != "scalar"]
# Block counts around the lane widths (4, 8) and the 64-block leaf batch, and
# block sizes around BLAKE2b's 128-byte chunk (32 tokens): a short last chunk,
# a full one, one more token than a chunk, several chunks.
N_BLOCKS = (0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 72, 131)
BLOCK_TOKENS = (1, 7, 8, 16, 31, 32, 33, 64, 100)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 111, 127, 128, 129, 255, 256, 257, 1000, 4096])
def test_blake2b_matches_hashlib_with_every_parameter(n: int) -> None:
    rng = random.Random(n)
    data = rng.randbytes(n)
    for digest_size in (1, 16, 20, 32, 64):
        for key_len in (0, 1, 16, 64):
            key = rng.randbytes(key_len)
            salt, person = rng.randbytes(16), rng.randbytes(rng.randint(0, 16))
            want = hashlib.blake2b(data, digest_size=digest_size, key=key, salt=salt,
                                   person=person).digest()
            got = native.blake2b(data, digest_size=digest_size, key=key, salt=salt, person=person)
            assert got == want, (n, digest_size, key_len)


def test_blake2b_rfc7693_abc_vector() -> None:
    # RFC 7693 Appendix A: BLAKE2b-512("abc").
    assert native.blake2b(b"abc").hex().startswith("ba80a53f981c4d0d6a2797b69f12f6e9")


def test_paths_include_scalar_and_default_is_fastest() -> None:
    assert PATHS[0] == "scalar"
    assert set(PATHS) <= {"scalar", "avx2", "avx512"}
    wanted = os.environ.get("KVSERVE_HASH_PATH") or PATHS[-1]
    assert wanted == native.HASH_PATH


@pytest.mark.parametrize("block_tokens", BLOCK_TOKENS)
@pytest.mark.parametrize("tenant", ["default", "acme", "a.b-c_9"])
def test_chain_native_equals_fallback(block_tokens: int, tenant: str) -> None:
    rng = np.random.default_rng(block_tokens)
    b = block_tokens
    for n in (0, 1, b - 1, b, b + 1, 2 * b, 5 * b + 3, 37 * b, 70 * b + 1):
        tokens = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
        kw = dict(block_tokens=b, tenant=tenant, fingerprint=FP)
        want = chain_keys_py(tokens, **kw)
        assert len(want) == n // b
        for path in PATHS:
            assert chain_keys_native(tokens, path=path, **kw) == want, (path, n)


@pytest.mark.skipif(not SIMD_PATHS, reason="no SIMD path on this CPU")
@pytest.mark.parametrize("block_tokens", BLOCK_TOKENS)
def test_simd_paths_agree_with_scalar(block_tokens: int) -> None:
    rng = np.random.default_rng(1000 + block_tokens)
    person = tenant_person("t", FP)
    root = root_key(person)
    for n_blocks in N_BLOCKS:
        n = n_blocks * block_tokens + int(rng.integers(0, block_tokens))  # ragged tail
        # One token of offset: the SIMD loads must not assume 8-byte alignment.
        raw = rng.integers(0, 2**32, size=n + 1, dtype=np.uint64).astype("<u4").tobytes()
        tokens = np.frombuffer(raw, dtype="<u4", offset=4)
        want = native.chain(tokens, block_tokens, root, person, path="scalar")
        assert len(want) == 16 * n_blocks
        for path in SIMD_PATHS:
            assert native.chain(tokens, block_tokens, root, person, path=path) == want, \
                (path, n_blocks)


def test_unknown_path_names_the_choices() -> None:
    person = tenant_person("t", FP)
    with pytest.raises(ValueError, match=r"unknown hash path 'sse9'.*scalar"):
        native.chain(b"", 64, root_key(person), person, path="sse9")


# Runs in a child so a stray read past the buffer kills the child, not pytest:
# the tokens end exactly where an unreadable page starts.
_GUARD_PAGE_CHILD = """
import ctypes, mmap, sys
import numpy as np
import native
from kvstore.keys import chain_keys_native, chain_keys_py
assert native.HASH_PATH == sys.argv[1], native.HASH_PATH
page = mmap.PAGESIZE
mem = mmap.mmap(-1, 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base + page, page, 0) == 0, ctypes.get_errno()
rng = np.random.default_rng(5)
for b in (1, 3, 7, 16, 31, 32, 33, 100):
    n = (page // 4 // b) * b
    tokens = np.frombuffer(mem, dtype="<u4", count=n, offset=page - 4 * n)
    tokens[:] = rng.integers(0, 2**32, size=n, dtype=np.uint64)
    kw = dict(block_tokens=b, tenant="t", fingerprint=bytes(16))
    assert chain_keys_native(tokens, **kw) == chain_keys_py(tokens, **kw), b
print("ok")
"""


@pytest.mark.parametrize("path", PATHS)
def test_env_var_forces_path_and_reads_stay_in_bounds(path: str) -> None:
    env = {**os.environ, "KVSERVE_HASH_PATH": path}
    out = subprocess.run([sys.executable, "-c", _GUARD_PAGE_CHILD, path], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_env_var_with_unknown_path_fails_at_import() -> None:
    env = {**os.environ, "KVSERVE_HASH_PATH": "neon"}
    out = subprocess.run([sys.executable, "-c", "import native"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "KVSERVE_HASH_PATH='neon'" in out.stderr


def test_chain_accepts_every_buffer_kind() -> None:
    ids = list(range(1000, 1000 + 256))
    person = tenant_person("t", FP)
    root = root_key(person)
    want = native.chain(np.array(ids, dtype="<u4"), 64, root, person)
    assert len(want) == 4 * 16
    assert native.chain(array("I", ids), 64, root, person) == want
    assert native.chain(np.array(ids, dtype="<u4").tobytes(), 64, root, person) == want
    assert native.chain(bytearray(np.array(ids, dtype="<u4").tobytes()), 64, root, person) == want


def test_chain_rejects_wrong_buffers() -> None:
    person = tenant_person("t", FP)
    root = root_key(person)
    with pytest.raises(TypeError, match="4-byte unsigned"):
        native.chain(np.arange(64, dtype=np.int64), 64, root, person)
    with pytest.raises(ValueError, match="multiple of 4"):
        native.chain(b"abcde", 1, root, person)
    with pytest.raises(ValueError, match="16 bytes"):
        native.chain(b"", 64, root[:8], person)
    with pytest.raises(ValueError, match="block_tokens"):
        native.chain(b"", 0, root, person)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        native.chain(np.arange(128, dtype=np.uint32)[::2], 64, root, person)  # not contiguous


def test_chain_releases_the_gil() -> None:
    """While one thread hashes 32 MiB in C, another keeps running Python."""
    person = tenant_person("t", FP)
    buf = np.zeros(8 << 20, dtype=np.uint32)
    started, done = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        native.chain(buf, 64, root_key(person), person)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    spins = 0
    while not done.is_set():
        spins += 1
    t.join()
    # Holding the GIL for the whole ~30 ms call would allow only a handful of spins.
    assert spins > 10_000


def test_chain_list_splits_chain() -> None:
    person = tenant_person("t", FP)
    tokens = np.arange(64 * 5 + 1, dtype=np.uint32)
    flat = native.chain(tokens, 64, root_key(person), person)
    assert native.chain_list(tokens, 64, root_key(person), person) == \
        [flat[i:i + 16] for i in range(0, len(flat), 16)]
