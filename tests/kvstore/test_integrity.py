"""Keyed integrity at rest (docs/security.md, "Integrity at rest and quotas"): real
``kvserve store serve`` processes, a real Redis, moto_server for S3, and the real
``kvserve store reindex``.

Someone who can write the G3 directory or the G4 bucket but lacks the deployment
secret makes blocks of the right format whose xxh3 checksum is right and whose MAC
is not (any key of theirs), moves a genuine file to another key, or leaves files of
the old, unkeyed format: none of them is ever served (reads answer "missing", so
the block is recomputed) and none is ever indexed by a reindex. Files and
directories of G3 and of a local G4 are private (a walk over modes, and a read
attempt as another uid); looser ones are tightened at start, and a directory owned
by another user is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import xxhash

from kvstore.blockfile import (
    UNKEYED,
    BlockCorruptError,
    BlockMac,
    BlockMeta,
    checksum,
    decode_block,
    encode_block,
)
from kvstore.client import KVStoreClient
from kvstore.integrity import block_mac, derive_mac_key, read_key_file, write_key_file
from kvstore.tiers.base import key_relpath
from kvstore.tiers.objstore import OPTIONS_ENV
from kvstore.types import RequestCtx
from security.config import SecurityConfig, SecurityError
from security.pki import CertAuthority, CertRequest
from tests.kvstore.s3proc import ACCESS, MotoS3
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys, write_config

ACME = RequestCtx(tenant="acme")
ATTACKER = BlockMac(os.urandom(32))     # whoever writes the disk, without the secret


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 120))


def _durable_config(tmp_path: Path) -> Path:
    """Puts answer once their blocks are on the first lower tier (G3, else G4)."""
    path = write_config(tmp_path / "kv.toml")
    path.write_text(path.read_text() + '[classes.ack]\nchat = "durable"\n')
    return path


def _meta(key: bytes, tenant: str = "acme") -> BlockMeta:
    return BlockMeta(key, "", LAYOUT, 4, "chat", time.time() + 3600, tenant=tenant)


def _forged(key: bytes, payload: bytes) -> bytes:
    """Right format, right xxh3 of its payload, the attacker's own MAC key."""
    return encode_block(payload, _meta(key), mac=ATTACKER)


def _old_format(key: bytes, payload: bytes) -> bytes:
    """A block as kvserve wrote it before keyed integrity (format v1: an unkeyed
    xxh3-64 of the header in place of the MAC)."""
    md = {"format": "kvserve-block-v1", "key": key.hex(), "fingerprint": "", "layout": LAYOUT,
          "token_count": "4", "traffic_class": "chat", "expires_at": repr(time.time() + 3600),
          "checksum": checksum(payload).hex(), "size": str(len(payload)),
          "compression": "none", "tenant": "acme"}
    tensor = {"dtype": "F32", "shape": [2, 2, 2, 4, 8], "data_offsets": [0, len(payload)]}
    canon = json.dumps({"kv": tensor, "__metadata__": md}, sort_keys=True,
                       separators=(",", ":")).encode()
    md["header_checksum"] = xxhash.xxh3_64_hexdigest(canon)
    text = json.dumps({"kv": tensor, "__metadata__": md}, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return len(text).to_bytes(8, "little") + text + payload


def _plant(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".plant")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _reindex(redis_url: str, *tier_args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "store", "reindex",
                          "--redis-url", redis_url, "--node", "n1", "--json", *tier_args],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


async def _matched(address: str, ks: list[bytes]) -> int:
    async with KVStoreClient(address, use_shm=False) as c:
        return (await c.lookup(ks, prompt_tokens=4 * len(ks) + 1, ctx=ACME)).matched_blocks


def test_forged_and_old_g3_blocks_are_never_served_nor_reindexed(
        redis_url: str, tmp_path: Path, tls_dir: str) -> None:
    g3 = tmp_path / "g3"
    ks, data = keys(6), blocks(6)
    planted, moved = keys(2, seed=50)
    # G2 keeps the last two blocks; all six are on disk when the put answers.
    store = StoreProc.start(redis_url, g3, g2_bytes="2KiB", config=_durable_config(tmp_path))
    try:
        async def put() -> None:
            async with KVStoreClient(store.address, use_shm=False) as c:
                assert (await c.put(ks, data, layout=LAYOUT, token_count=4,
                                    ctx=ACME)).stored == 6

        run(put)
        # The store's files verify under the deployment's key only.
        genuine = (g3 / key_relpath(ks[2])).read_bytes()
        secret = SecurityConfig(tls_dir, role="kvstore").require_secret()
        decode_block(genuine, ks[2], mac=BlockMac(derive_mac_key(secret)))
        for wrong in (UNKEYED, ATTACKER):
            with pytest.raises(BlockCorruptError, match="MAC"):
                decode_block(genuine, ks[2], mac=wrong)
        # The attacks, while the store runs.
        _plant(g3 / key_relpath(ks[0]), _forged(ks[0], b"\x66" * 1024))     # swapped bytes
        _plant(g3 / key_relpath(ks[1]), _old_format(ks[1], bytes(data[1])))  # old format
        _plant(g3 / key_relpath(planted), _forged(planted, b"\x77" * 1024))  # a new block
        _plant(g3 / key_relpath(moved), genuine)                             # another key's

        async def read() -> tuple[list[bytes | None], dict[str, int]]:
            async with KVStoreClient(store.address, use_shm=False) as c:
                got = await c.get(ks, ctx=ACME)
                bad = {t.tier: t.checksum_failures for t in (await c.stats()).tiers}
                return [bytes(p) if p is not None else None for p in got.payloads], bad

        payloads, bad = run(read)
        assert payloads == [None, None, *[bytes(d) for d in data[2:]]]   # recompute 0 and 1
        assert bad["G3"] == 2
        assert not (g3 / key_relpath(ks[0])).exists() and not (g3 / key_relpath(ks[1])).exists()
        # Redis loses everything; a reindex beside the running store indexes only blocks
        # whose MAC verifies under the store's key. One run with a wrong key indexes
        # nothing and deletes nothing (only the store itself removes bad files).
        redis.Redis.from_url(redis_url).flushall()
        wrong = write_key_file(tmp_path / "wrong.key", os.urandom(32))
        files = sorted(g3.rglob("*.kvb"))
        assert _reindex(redis_url, "--g3-path", str(g3), "--integrity-key-file",
                        str(wrong))["blocks"] == {"G3": 0}
        assert sorted(g3.rglob("*.kvb")) == files
        report = _reindex(redis_url, "--g3-path", str(g3))
        assert report["blocks"] == {"G3": 4}
        assert run(lambda: _matched(store.address, ks[2:])) == 4
        assert run(lambda: _matched(store.address, [planted])) == 0
        assert run(lambda: _matched(store.address, [moved])) == 0
    finally:
        store.terminate()
    # The store's next start removes what does not verify.
    StoreProc.start(redis_url, g3, g2_bytes="2KiB", config=_durable_config(tmp_path)).terminate()
    assert not (g3 / key_relpath(planted)).exists() and not (g3 / key_relpath(moved)).exists()
    assert len(list(g3.rglob("*.kvb"))) == 4


def test_forged_g4_objects_are_never_served_nor_reindexed(
        redis_url: str, tmp_path: Path, moto_s3: MotoS3, s3_bucket: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    monkeypatch.setenv(OPTIONS_ENV, json.dumps({**moto_s3.options(),
                                                "skip_instance_cache": True}))
    g4 = f"{s3_bucket}/g4"
    fs = s3fs.S3FileSystem(endpoint_url=moto_s3.endpoint, **ACCESS, skip_instance_cache=True,
                           use_listings_cache=False)
    ks, data = keys(4, seed=3), blocks(4, seed=3)
    (planted,) = keys(1, seed=60)
    config = _durable_config(tmp_path)
    args = ["--g4-url", g4]
    store = StoreProc.start(redis_url, None, g2_bytes="64KiB", config=config, extra=args)
    try:
        async def put() -> None:
            async with KVStoreClient(store.address, use_shm=False) as c:
                await c.put(ks, data, layout=LAYOUT, token_count=4, ctx=ACME)

        run(put)
    finally:
        store.terminate()
    root = g4.removeprefix("s3://")
    fs.pipe_file(f"{root}/{key_relpath(ks[0])}", _forged(ks[0], b"\x55" * 1024))
    fs.pipe_file(f"{root}/{key_relpath(planted)}", _forged(planted, b"\x44" * 1024))
    store = StoreProc.start(redis_url, None, g2_bytes="64KiB", config=config, extra=args)
    try:
        async def read() -> list[bytes | None]:       # G2 died: every read goes to G4
            async with KVStoreClient(store.address, use_shm=False) as c:
                got = await c.get(ks, ctx=ACME)
                return [bytes(p) if p is not None else None for p in got.payloads]

        assert run(read) == [None, *[bytes(d) for d in data[1:]]]
        assert not fs.exists(f"{root}/{key_relpath(ks[0])}")
        redis.Redis.from_url(redis_url).flushall()
        report = _reindex(redis_url, *args)
        assert report["blocks"] == {"G4": 3}
        assert run(lambda: _matched(store.address, [planted])) == 0
        assert run(lambda: _matched(store.address, ks[1:])) == 3
    finally:
        store.terminate()


def _modes(root: Path) -> list[str]:
    """Every path under ``root`` (and root) with any group/other permission bit."""
    loose = []
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        if stat.S_IMODE(st.st_mode) & 0o077:
            loose.append(f"{p} {stat.S_IMODE(st.st_mode):o}")
    return loose


def _peek_as_nobody(*roots: Path) -> int | None:
    """How many directories and files under ``roots`` uid 65534 may read, by the
    kernel's own check (None: not root, cannot switch users)."""
    if os.geteuid() != 0:
        return None
    out = subprocess.run(["/bin/sh", "-c", 'find "$@" -readable \\( -type d -o -type f \\) '
                          "-print 2>/dev/null | wc -l", "peek", *map(str, roots)],
                         user=65534, cwd="/", capture_output=True, text=True, timeout=60)
    return int(out.stdout)


def test_g3_and_local_g4_are_private_to_the_store(redis_url: str) -> None:
    # Under a directory every user may traverse (pytest's own is 0700, which would
    # hide a leak), so only the store's own modes stand between others and the blocks.
    base = Path(tempfile.mkdtemp(prefix="kvserve-h4b-modes-"))
    base.chmod(0o755)
    g3, g4 = base / "g3", base / "g4"
    config = _durable_config(base)
    args = ["--g4-url", f"fsspec+file://{g4}"]
    try:
        store = StoreProc.start(redis_url, g3, g2_bytes="2KiB", config=config, extra=args)
        try:
            async def put() -> None:
                async with KVStoreClient(store.address, use_shm=False) as c:
                    await c.put(keys(8), blocks(8), layout=LAYOUT, token_count=4, ctx=ACME)

            run(put)
        finally:
            store.terminate()                    # drains: the G4 copies are written too
        assert len(list(g3.rglob("*.kvb"))) == 8 and len(list(g4.rglob("*.kvb"))) == 8
        assert _modes(g3) == [] and _modes(g4) == []
        assert _peek_as_nobody(g3, g4) in (0, None)
        # A tree left looser (an older version, a careless copy) is readable by others
        # (the check above can fail) until the store's next start tightens it.
        for p in (g3, *g3.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)
        leaked = _peek_as_nobody(g3)
        assert _modes(g3) and (leaked is None or leaked > 8)
        store = StoreProc.start(redis_url, g3, g2_bytes="2KiB", config=config, extra=args)
        store.terminate()
        assert _modes(g3) == [] and len(list(g3.rglob("*.kvb"))) == 8
        assert _peek_as_nobody(g3) in (0, None)
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another uid needs root")
def test_a_g3_directory_of_another_user_is_refused(redis_url: str, tmp_path: Path) -> None:
    g3 = tmp_path / "g3"
    g3.mkdir(mode=0o700)
    os.chown(g3, 65534, 65534)
    with pytest.raises(RuntimeError, match="belongs to uid 65534"):
        StoreProc.start(redis_url, g3, g2_bytes="2KiB")
    shutil.rmtree(g3)


def test_the_mac_key_comes_from_the_secret_never_is_it(tmp_path: Path, tls_dir: str) -> None:
    secret = SecurityConfig(tls_dir, role="kvstore").require_secret()
    key = derive_mac_key(secret)
    assert len(key) == 32 and key != secret and secret.hex() not in key.hex()
    assert derive_mac_key(secret[::-1]) != key
    mac = block_mac(SecurityConfig(tls_dir, role="kvstore"))
    assert mac.keyed and key.hex() not in repr(mac)
    # A key file instead of the secret: 0600, never over an existing file, never
    # readable by everyone.
    path = write_key_file(tmp_path / "integrity.key", key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_key_file(path) == key
    with pytest.raises(FileExistsError):
        write_key_file(path, key)
    mine = BlockMac(key)
    k = keys(1)[0]
    assert decode_block(encode_block(b"x" * 64, _meta(k), mac=block_mac(None, str(path))), k,
                        mac=mine).payload.tobytes() == b"x" * 64
    path.chmod(0o644)
    with pytest.raises(SecurityError, match="readable by every user"):
        read_key_file(path)
    # A deployment identity without a secret is refused; plain text without one is
    # unkeyed (and says so).
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    ident = tmp_path / "id" / "kvstore"
    ident.mkdir(parents=True)
    ca.issue(CertRequest("kvstore")).save(ident)
    with pytest.raises(SecurityError, match="secret"):
        block_mac(SecurityConfig(str(ident)))
    assert block_mac(SecurityConfig(insecure=True)) is UNKEYED
