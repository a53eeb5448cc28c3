"""G4 on S3: the fsspec tier through s3fs against moto's standalone S3 server on
loopback. Write-once, checksums verified on read (a flipped byte is never
served), credentials from env, multipart uploads, and an outage that turns
into recompute (counted) instead of an error or a lost index entry."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import s3fs

from kvstore.blockfile import BlockMeta
from kvstore.tiers.objstore import OPTIONS_ENV, ObjectTier
from kvstore.types import TIER_BITS, RequestCtx
from kvstore.warehouse import Warehouse
from tests.kvstore.s3proc import ACCESS, MotoS3
from tests.kvstore.storeproc import LAYOUT, blocks, keys, wh_config

CTX = RequestCtx()


def _block(seed: int, nbytes: int = 64 * 1024) -> tuple[bytes, bytes, BlockMeta]:
    rng = np.random.default_rng(seed)
    key = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    payload = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return key, payload, BlockMeta(key, "fp" * 16, "raw", 64, "chat", 2e9)


def _tier(url: str, server: MotoS3, **kw: object) -> ObjectTier:
    return ObjectTier(f"{url}/g4", name="G4", capacity_bytes=1 << 40,
                      storage_options={**server.options(), "skip_instance_cache": True},
                      **kw)  # type: ignore[arg-type]


def _raw_fs(server: MotoS3) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(endpoint_url=server.endpoint, **ACCESS, skip_instance_cache=True,
                             use_listings_cache=False)


def test_put_get_verify_and_write_once_across_nodes(moto_s3: MotoS3, s3_bucket: str) -> None:
    a, b = _tier(s3_bucket, moto_s3), _tier(s3_bucket, moto_s3)
    key, payload, meta = _block(1)
    out = a.put(key, payload, meta)
    assert out.stored and not out.existed
    assert b.contains(key)                          # the other node sees the shared object
    hit = b.get(key)
    assert hit is not None and bytes(hit.payload) == payload and hit.meta.key == key
    again = b.put(key, b"\0" * len(payload), meta)  # write-once: never overwritten
    assert again.existed
    assert bytes(a.get(key).payload) == payload     # type: ignore[union-attr]
    obj = _raw_fs(moto_s3).info(a.path(key))
    assert obj["size"] > len(payload)               # header + payload, one object
    c = _tier(s3_bucket, moto_s3)                   # a restarted node adopts what is there
    assert c.keys() == [key] and [m.key for m in c.scan()] == [key]


def test_flipped_byte_is_detected_and_never_served(moto_s3: MotoS3, s3_bucket: str) -> None:
    tier = _tier(s3_bucket, moto_s3)
    key, payload, meta = _block(2)
    tier.put(key, payload, meta)
    fs = _raw_fs(moto_s3)
    data = bytearray(fs.cat_file(tier.path(key)))
    data[-100] ^= 0x01                              # one bit of the payload
    fs.pipe_file(tier.path(key), bytes(data))
    assert tier.get(key) is None
    assert tier.stats().checksum_failures == 1
    assert not fs.exists(tier.path(key))            # the bad object is gone
    assert tier.get(key) is None                    # and stays a miss


def test_multipart_upload_for_large_segments(moto_s3: MotoS3, s3_bucket: str) -> None:
    tier = _tier(s3_bucket, moto_s3, multipart_bytes=5 * 2**20)
    key, payload, meta = _block(3, nbytes=12 * 2**20)
    assert tier.put(key, payload, meta).stored
    assert tier.multipart_puts == 1
    etag = _raw_fs(moto_s3).info(tier.path(key))["ETag"].strip('"')
    assert etag.endswith("-3")                      # S3's multipart ETag: 3 parts
    hit = tier.get(key)
    assert hit is not None and bytes(hit.payload) == payload
    small_key, small, small_meta = _block(4)
    tier.put(small_key, small, small_meta)
    assert tier.multipart_puts == 1                 # small objects: one PUT


def test_credentials_and_endpoint_from_environment(moto_s3: MotoS3, s3_bucket: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ACCESS["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    tier = ObjectTier(f"{s3_bucket}/env", name="G4", capacity_bytes=1 << 30,
                      storage_options={"skip_instance_cache": True})
    key, payload, meta = _block(5)
    tier.put(key, payload, meta)
    assert bytes(tier.get(key).payload) == payload  # type: ignore[union-attr]
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"endpoint_url": moto_s3.endpoint,
                                                "skip_instance_cache": True}))
    other = ObjectTier(f"{s3_bucket}/env", name="G4", capacity_bytes=1 << 30)
    assert other.contains(key)
    monkeypatch.setenv(OPTIONS_ENV, "[1]")
    with pytest.raises(ValueError, match="JSON object"):
        ObjectTier(f"{s3_bucket}/env", name="G4", capacity_bytes=1 << 30)


def test_server_down_is_a_counted_miss_then_recovers(s3_bucket: str, moto_s3: MotoS3,
                                                     redis_url: str, tmp_path: Path) -> None:
    """A G4-only warehouse: S3 stops answering -> gets are misses (recompute),
    counted, fast after the first failure, and the index keeps its G4 bits."""
    server = MotoS3().start()
    try:
        url = server.make_bucket("outage")

        async def body() -> None:
            os.environ[OPTIONS_ENV] = json.dumps({**server.options(),
                                                  "skip_instance_cache": True})
            try:
                wh = await Warehouse(wh_config(redis_url, g2_bytes=0, g4=f"{url}/g4")).start()
            finally:
                del os.environ[OPTIONS_ENV]
            tier = wh.tiers["G4"]
            assert isinstance(tier, ObjectTier)
            ks = keys(3, seed=7)
            await wh.put(ks, blocks(3), layout=LAYOUT, token_counts=[4] * 3, ctx=CTX)
            await wh.flush()
            assert [f.tier for f in await wh.get(ks, ctx=CTX)] == ["G4"] * 3
            server.stop()
            t0 = time.monotonic()
            got = await wh.get(ks, ctx=CTX)
            assert [f.tier for f in got] == ["", "", ""]          # recompute, no error
            assert tier.unavailable == 3 and time.monotonic() - t0 < 10
            t1 = time.monotonic()
            await wh.get(ks, ctx=CTX)
            assert time.monotonic() - t1 < 0.5                   # marked down: fails fast
            assert tier.unavailable == 6
            entries = await wh.index.entries(ks)
            assert all(e is not None and e.tiers & TIER_BITS["G4"] for e in entries)
            server.start()                       # back on its port (empty: moto keeps RAM)
            server.make_bucket("outage")
            await asyncio.sleep(tier.down_cooldown_s + 0.1)
            again = keys(2, seed=8)
            await wh.put(again, blocks(2), layout=LAYOUT, token_counts=[4] * 2, ctx=CTX)
            await wh.flush()
            assert [f.tier for f in await wh.get(again, ctx=CTX)] == ["G4", "G4"]
            assert tier.unavailable == 6                         # answering again
            await wh.close()

        asyncio.run(body())
    finally:
        server.stop()
